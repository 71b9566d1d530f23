# Two commands on a fresh machine:  `make serve` (set up, then serve the default model)
# and `make test` (set up, then lint and run the test suite).
.PHONY: setup serve generate test test-quick lint docs bench

setup:
	@scripts/setup.sh

serve: setup
	.venv/bin/tandem serve $(ARGS)

generate: setup
	.venv/bin/tandem generate $(or $(ARGS),--chat "Write a haiku about paged attention.")

lint: setup
	.venv/bin/ruff check tandem tests benchmarks scripts
	.venv/bin/ruff format --check tandem tests benchmarks scripts

# The 25 slowest tests are listed at the end: where the suite's time goes.
test: lint
	.venv/bin/python -m pytest --durations=25 $(ARGS)

# Without the end-to-end tests marked slow: about 3.5 minutes on 2 cores.
test-quick: lint
	.venv/bin/python -m pytest -m "not slow" $(ARGS)

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
