.PHONY: demo test gate setup

demo:  ## fresh machine: install, quantize the bundled model, evaluate, generate
	bash scripts/demo.sh

test:  ## fresh machine: install, run the CPU test suite
	bash scripts/test.sh

gate:  ## quantize the bundled model with the default recipe and gate it against the original (CI)
	bash scripts/gate.sh

setup:
	bash scripts/setup.sh dev
