"""`loraplex serve` with and without `--replicas`: Ray only when asked, shared state checked first."""

from __future__ import annotations

import subprocess
import sys

from loraplex.cli import main


def test_serve_without_replicas_imports_no_ray():
    code = ("import sys, loraplex.cli, loraplex.platform.serve, loraplex.platform.main, loraplex.platform.gateway; "
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_several_replicas_need_redis_for_quotas(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("LORAPLEX_REDIS_URL", raising=False)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "set LORAPLEX_REDIS_URL" in err and "2 engine replicas" in err
    assert not (tmp_path / "loraplex.db").exists()  # refused before anything was written


def test_scale_out_options_need_replicas(capsys):
    assert main(["serve", "--ingresses", "2"]) == 2
    assert "need --replicas" in capsys.readouterr().err
