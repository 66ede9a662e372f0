"""The vLLM commands (console scripts in pyproject.toml; the example scripts wrap them). Importing this package
imports no vLLM: a mistake in the arguments is one line on stderr, before vLLM prints anything.

    calibrate.py       `modelopt-ext-calibrate`: calibrate through a vLLM engine, write `sparse_attention_config`
    serve.py           `modelopt-ext-serve`: vLLM's OpenAI server with the checkpoint checked and the plugin's RPCs
    arguments.py       the calibrate command's parser (vLLM's engine arguments plus its own) and its checks
    engine_control.py  signals, engine shutdown and leftover processes, a private temporary folder, held stderr
    engine_setup.py    what both commands check and set before an engine starts (context length, TP, CPU binding)
    serving_bench.py   the serving benchmark's two servers and vLLM's own `bench serve` runs (benchmarks/serving.py)
"""
