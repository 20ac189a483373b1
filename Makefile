# minivit: the two commands are `make test` and `make train`; the rest are conveniences.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PARITY_VENV := .venv-parity
PARITY_PY := $(PARITY_VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: test test-parity train demo lab bench clean

# The environment is rebuilt only when requirements.txt or pyproject.toml change.
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

## make test: set up .venv (first time), check the code with ruff (pyproject.toml), run the whole test suite on the CPU
test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The reference oracles (PyTorch + timm, open_clip for CLIP, transformers for Hugging Face folders) live in their own venv: never a runtime dependency.
$(PARITY_VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_PY) -m pip install -q torch==2.14.1 torchvision==0.29.1 timm open_clip_torch==3.3.0 transformers==5.23.0
	$(PARITY_PY) -m pip install -q numpy scipy numba threadpoolctl pillow tqdm matplotlib safetensors pytest mpi4py mpich
	$(PARITY_PY) -m pip install -q --no-deps -e .
	touch $@

## make test-parity: compare logits and every gradient with timm and transformers (and CLIP with open_clip and
## transformers) under PyTorch autograd
test-parity: $(PARITY_VENV)/.installed
	$(PARITY_PY) -m pytest -m parity $(PYTEST_ARGS)

## make train: the main job, a small ViT on CIFAR-10 (falls back to Fashion-MNIST or shapes offline), into
## runs/cifar10 (or runs/fashion-mnist, runs/shapes: the data set it trained on); ARGS=--resume continues it
train: $(VENV)/.installed
	$(PY) -m minivit.train --dataset cifar10 --download --fallback --out 'runs/{dataset}' $(ARGS)

## make demo: the offline quick run on the procedural `shapes` data set (about three minutes on 2 cores)
demo: $(VENV)/.installed
	$(PY) -m minivit.train --dataset shapes --recipe demo --out runs/demo $(ARGS)

## make lab: Jupyter in the notebooks folder, with the project's environment
lab: $(VENV)/.installed
	cd notebooks && ../$(VENV)/bin/jupyter lab

## make bench: speed and memory against PyTorch eager, side by side (needs the parity venv for torch);
## then a CLIP training step against open_clip's (benchmarks/bench_clip.py)
bench: $(PARITY_VENV)/.installed
	$(PARITY_PY) benchmarks/bench.py $(ARGS)
	$(PARITY_PY) benchmarks/bench_clip.py

clean:
	rm -rf $(VENV) $(PARITY_VENV) .pytest_cache build *.egg-info
