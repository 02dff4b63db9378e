PY := .venv/bin/python

.PHONY: venv serve test clean

venv:
	@./scripts/venv.sh

# The main job: the Serve application on the embedded tiny model (CPU), on http://127.0.0.1:8000.
# The random tiny checkpoint is written to checkpoints/tiny on first start.
serve: venv
	.venv/bin/serve run config.yaml

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv checkpoints
