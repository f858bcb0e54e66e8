# The two commands a newcomer needs (README):  make run   |   make test
PYTHON ?= python3
STAMP := build/.installed

.PHONY: setup run test lint bench-kernels clean

# Install the package (editable) with its extras, then compile the C++ kernels once.
# Re-runs only when pyproject.toml changes; `make setup -B` forces it.
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -e ".[dev,vision,nlp,ft]"
	@# Real Fashion-MNIST for the fashion_mnist recipe, from Debian when apt (as root) has it;
	@# optional: without it the recipe needs recipe.data_dir, and the tests make their own IDX files.
	-@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& apt-cache policy dataset-fashion-mnist 2>/dev/null | grep -q 'Candidate: [0-9]'; then \
		apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
		|| echo "note: apt-get could not install dataset-fashion-mnist (optional; see docs/recipes.md)"; fi
	$(PYTHON) -m syncplane build-ext
	@mkdir -p build && touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PYTHON) train.py

test: setup
	$(PYTHON) -m pytest

# The layer contracts (import-linter) and the no-import-cycle check.
lint: setup
	$(PYTHON) scripts/lint_imports.py

bench-kernels: setup
	$(PYTHON) scripts/bench_kernels.py

clean:
	rm -rf build outputs multirun .pytest_cache
