"""The command line's flags: ``declared`` (each flag's type and help, declared once), ``parse`` (values written as
text), ``jobs`` (the objects of the API their values build: ``preprocess``, ``budget``, ``compress_job``,
``recover_job``, ``sweep``), ``deploy`` (eval, bench and quantize's). A flag's values arrive as a dict keyed by the
command's parameter names: the CLI passes its own, the benchmarks read a flag list through the CLI's parser
(``onnxprune.cli.flag_values``), so both build the same objects from the same flags and defaults.
"""
