.PHONY: demo test setup

demo:  ## fresh machine: install, quantize the bundled model, evaluate, generate
	bash scripts/demo.sh

test:  ## fresh machine: install, run the CPU test suite
	bash scripts/test.sh

setup:
	bash scripts/setup.sh dev
