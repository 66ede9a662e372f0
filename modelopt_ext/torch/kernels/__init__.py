"""modelopt-ext: calibrated skip-softmax sparse attention for vLLM serving."""
