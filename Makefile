# The two commands a newcomer needs (README):  make run   |   make test
PYTHON ?= python3
STAMP := build/.installed

.PHONY: setup run test bench-kernels clean

# Install the package (editable) with its extras, then compile the C++ kernels once.
# Re-runs only when pyproject.toml changes; `make setup -B` forces it.
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -e ".[dev,vision]"
	$(PYTHON) -m syncplane build-ext
	@mkdir -p build && touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PYTHON) train.py

test: setup
	$(PYTHON) -m pytest

bench-kernels: setup
	$(PYTHON) scripts/bench_kernels.py

clean:
	rm -rf build outputs multirun .pytest_cache
