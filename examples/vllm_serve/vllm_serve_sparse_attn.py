#!/usr/bin/env python3
"""Serve a checkpoint with calibrated skip-softmax sparse attention through vLLM's OpenAI-compatible server.

    python examples/vllm_serve/vllm_serve_sparse_attn.py <ckpt> [any vllm serve arguments]

The same program as the console script `modelopt-ext-serve` (installed with the package); the work is done by
`modelopt_ext.torch.sparsity.attention_sparsity.cli.serve`. Plain `vllm serve <ckpt>` serves a
calibrated checkpoint sparse too (the package's vLLM general plugin).
"""

import sys

from modelopt_ext.torch.sparsity.attention_sparsity.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
