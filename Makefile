# Every target builds .venv itself when it is missing: torch==2.13.0 first (the
# local CPU wheel), so the project's torch range never pulls a CUDA build.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv toolchains demo test test-slow verify-strict bench fpga-report clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The Debian packages the targets (qnorm/data/targets/*.toml) build and run with (cross
# gcc, qemu-user, PoCL): installed only when one is missing, so a ready machine pays one
# dpkg query.
# `make test` needs them; QNORM_SKIP_TOOLCHAINS=1 skips the install instead (on a
# machine without root), and those targets' tests then skip with the reason.
toolchains: $(STAMP)
	@if [ -n "$$QNORM_SKIP_TOOLCHAINS" ]; then echo "toolchains: skipped (QNORM_SKIP_TOOLCHAINS)"; exit 0; fi; \
	pkgs="$$($(VPY) -c 'from qnorm.targets import debian_packages; print(*debian_packages())')"; \
	missing="$$(for p in $$pkgs; do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done)"; \
	if [ -z "$$missing" ]; then echo "toolchains: all present ($$pkgs)"; else \
	  echo "toolchains: installing $$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; } \
	  || { echo "toolchains: could not install $$missing (set QNORM_SKIP_TOOLCHAINS=1 to test without them)"; exit 1; }; \
	fi

demo: $(STAMP)
	$(VPY) -m qnorm.cli demo --out out

test: $(STAMP) toolchains
	$(VPY) -m ruff check --quiet .
	$(VPY) -m pytest -q -n auto

# pytest exits 5 when a marker selects nothing; that is not a failure here.
test-slow: $(STAMP) toolchains
	$(VPY) -m pytest -q -n auto -m slow || [ $$? -eq 5 ]

# Every verify column a CPU box with the toolchains above can prove, with --strict: a
# skip (a tool went missing) or compiled cell fails instead of passing quietly. cuda
# only compiles without a GPU; scripts/gpu_check.sh runs it where there is one.
STRICT_TARGETS := x86_64 aarch64 riscv64 opencl fpga-hls
verify-strict: $(STAMP) toolchains
	$(VPY) -m qnorm.cli verify --strict --target $(STRICT_TARGETS)

# Every benchmark in one process, one run (interleaved loops >= 0.5 s, medians of
# per-round ratios), written to out/bench.md: kernels (P1, P2; and at the AVX2 level
# on an AVX-512 host, in a child process with torch at AVX2), QAT step, compile (P4),
# transformer latency (compiled vs torch, per-op share).
bench: $(STAMP)
	$(VPY) -m benchmarks --out out/bench.md

# Every RTL unit through yosys (xc7, xcup, ecp5, ice40) and nextpnr (ecp5, ice40):
# out/fpga.md (LUT / FF / DSP / BRAM, Fmax, throughput, the P5 ratios, tool versions)
# and out/fpga.png. Results are cached per unit, tool version and flags.
fpga-report: $(STAMP)
	$(VPY) -m qnorm.cli synth --out out/fpga.md

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
