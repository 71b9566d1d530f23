# Two commands on a fresh machine:  `make serve` (set up, then serve the default model)
# and `make test` (set up, then lint and run the test suite).
.PHONY: setup serve generate test lint bench

setup:
	@scripts/setup.sh

serve: setup
	.venv/bin/tandem serve $(ARGS)

generate: setup
	.venv/bin/tandem generate $(or $(ARGS),--chat "Write a haiku about paged attention.")

lint: setup
	.venv/bin/ruff check tandem tests benchmarks
	.venv/bin/ruff format --check tandem tests benchmarks

test: lint
	.venv/bin/python -m pytest $(ARGS)
