PY := .venv/bin/python

.PHONY: venv serve test clean

venv:
	@./scripts/venv.sh

# The main job on the embedded tiny model (CPU); makes the random checkpoint on first use.
serve: venv
	$(PY) -m engine.generate --model tiny --prompt "Hello, who are you?" --max-tokens 32

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv checkpoints
