"""cli/local_server.py with a stand-in server process (no vLLM): health wait, /metrics parsing, stopping its group."""

from __future__ import annotations

import sys
import textwrap

import psutil
import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.cli import local_server

SERVER = textwrap.dedent('''
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an "engine" process
    METRICS = (
        "# HELP modelopt_sparse_attn_tiles_visited_total tiles\\n"
        'modelopt_sparse_attn_tiles_visited_total{phase="prefill"} 200.0\\n'
        'modelopt_sparse_attn_tiles_skipped_total{phase="prefill"} 50.0\\n'
        'modelopt_sparse_attn_tiles_visited_total{phase="decode"} 10.0\\n'
        'vllm:num_requests_running{model="m"} 0.0\\n'
    )
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (METRICS if self.path == "/metrics" else "ok").encode()
            self.send_response(200 if self.path in ("/metrics", "/health") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    print("child", child.pid, flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def test_running_server_reads_metrics_and_stops_the_whole_group(tmp_path):
    port = local_server.free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", SERVER, str(port)]
    env = local_server.server_env({"VLLM_SERVER_DEV_MODE": "1", "PATH": "/usr/bin:/bin"})
    assert "VLLM_SERVER_DEV_MODE" not in env and env["MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY"] == "1"
    with local_server.running_server(cmd, log, env, f"http://127.0.0.1:{port}", start_timeout=120) as base:
        metrics = local_server.sparse_metrics(base)
        assert set(metrics) == {'modelopt_sparse_attn_tiles_visited_total{phase="prefill"}',
                                'modelopt_sparse_attn_tiles_skipped_total{phase="prefill"}',
                                'modelopt_sparse_attn_tiles_visited_total{phase="decode"}'}
        assert local_server.tile_counts(metrics) == {"prefill": (200.0, 50.0), "decode": (10.0, 0.0)}
        child = psutil.Process(int(log.read_text().split()[1]))
        assert child.is_running()
    _, alive = psutil.wait_procs([child], timeout=60)  # SIGTERM went to the group: it ends (generous timeout)
    assert not alive, "the server's child outlived it"


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path):
    port = local_server.free_port()
    cmd = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with code 3"):
        with local_server.running_server(cmd, tmp_path / "s.log", local_server.server_env(),
                                         f"http://127.0.0.1:{port}", start_timeout=120):
            pass
    assert "bad flag" in (tmp_path / "s.log").read_text()
