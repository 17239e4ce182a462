# Every target builds .venv itself when it is missing: torch==2.13.0 first (the
# local CPU wheel), so the project's torch range never pulls a CUDA build.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m qnorm.cli demo --out out

test: $(STAMP)
	$(VPY) -m pytest -q -n auto

# pytest exits 5 when a marker selects nothing; that is not a failure here.
test-slow: $(STAMP)
	$(VPY) -m pytest -q -n auto -m slow || [ $$? -eq 5 ]

# Ratios measured in one run (interleaved loops >= 0.5 s, medians); written to out/.
bench: $(STAMP)
	$(VPY) -m benchmarks.bench_qat --out out/bench_qat.md

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
