#!/usr/bin/env python3
"""Calibrate skip-softmax thresholds through a vLLM engine and write `sparse_attention_config`.

    python examples/vllm_serve/calibrate_sparse_attn.py <ckpt> --target_sparse_ratio 0.5 \\
        [--attention_backend FLASHINFER] [--tensor_parallel_size N] [--update_checkpoint_config] \\
        [any vLLM engine argument: --block-size 32 --max-num-seqs 4 ...]

The same program as the console script `modelopt-ext-calibrate` (installed with the package); the work is done by
`modelopt_ext.torch.sparsity.attention_sparsity.cli.calibrate`. `--help` lists every option.
"""

import sys

from modelopt_ext.torch.sparsity.attention_sparsity.cli.calibrate import console_main

if __name__ == "__main__":
    sys.exit(console_main())
