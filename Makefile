# Two commands do everything on a fresh machine: `make plans` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup plans check-plans test bench bench-net benchmarks-doc history-check clean

setup: $(STAMP)

# torch first and pinned: a CPU build of 2.13.0 is at hand, while any range (or torch pulled in by
# the extras) would download a multi-GB CUDA build; the [torch] extra in `dev` is then already met.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

## Compile every reference case into plans/ and print the comparison table.
plans: $(STAMP)
	$(PY) -m xmesh_plan.planner.reference_cases --out plans

## Regenerate plans/ into a scratch folder, fail if anything differs from what is committed, verify each.
check-plans: $(STAMP)
	rm -rf .plans-check && mkdir -p .plans-check
	$(PY) -m xmesh_plan.planner.reference_cases --out .plans-check --quiet
	diff -r plans .plans-check
	$(VENV)/bin/xmesh-plan verify plans/*.plan.json
	rm -rf .plans-check

## Plans first, then the suite, so pytest's summary is the last line printed. Two pytest-xdist workers, each test
## file on one worker (its module-scoped launches run once): one runs in-process tests while the other's ranks run.
test: $(STAMP)
	$(MAKE) --no-print-directory check-plans
	$(PY) -m pytest -n 2 --dist loadfile

## Benchmarks: every bench/bench_*.py in turn, as a module of the bench package; results go to bench/results/,
## then BENCHMARKS.md is made from them.
bench: $(STAMP)
	@for f in bench/bench_*.py; do m=bench.$$(basename $$f .py); echo "== $$m"; $(PY) -m $$m || exit 1; done
	$(MAKE) --no-print-directory benchmarks-doc

## BENCHMARKS.md from bench/results/*.json (tests/test_benchmarks_doc.py fails when it is stale).
benchmarks-doc: $(STAMP)
	$(PY) bench/benchmarks_doc.py

## Every line of a tracked file that narrates development history instead of describing the software.
history-check: $(STAMP)
	$(PY) bench/history_check.py

## Plans on an emulated cluster (as root: network namespaces, shaped links); results go to bench/results/.
## Both executor orders, then the two side by side (an hour or so on 2 cores); NETLAB_ARGS narrows it, e.g. --cases case3 --rates 500.
bench-net: $(STAMP)
	$(PY) -m bench.netlab.experiments --order device --out netlab-device.json $(NETLAB_ARGS)
	$(PY) -m bench.netlab.experiments --order posted --out netlab-posted.json $(NETLAB_ARGS)
	$(PY) -m bench.netlab.summary --print bench/results/netlab-posted.json bench/results/netlab-device.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .plans-check build *.egg-info
