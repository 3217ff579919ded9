from onnxprune.cli import main

main()
