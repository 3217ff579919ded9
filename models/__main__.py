"""``python -m models NAME -o out.onnx [--weights imagenet|random] [--opset 17]``."""

from models.build import main

raise SystemExit(main())
