"""`tsukimi keys add|list|remove`: the key is printed once and stored only as its hash; misuse exits 2."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from shared.tools.cli.main import main
from shared.wire.api_keys import hash_key, load_api_keys


def keys_command(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(["keys", *args])
    except SystemExit as exc:  # argparse and CliError exit through parser.exit
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_add_prints_a_new_key_once_and_stores_its_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "conf" / "keys.json"
    code, out, err = keys_command(capsys, "add", "alice", "--file", str(path), "--rpm", "60", "--tpm", "1000",
                                  "--concurrency", "2")
    assert code == 0 and "shown only now" in err
    key = out.strip()
    assert key.startswith("tsk-") and len(key) > 40 and key not in err
    assert key not in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o644
    code, out, _ = keys_command(capsys, "add", "bob", "--file", str(path))
    other = out.strip()
    loaded = load_api_keys(path)
    assert [k.name for k in loaded.keys] == ["alice", "bob"] and other != key
    alice = loaded.find(key)
    assert alice is not None and alice.sha256 == hash_key(key)
    assert (alice.requests_per_minute, alice.tokens_per_minute, alice.max_concurrent) == (60, 1000, 2)
    assert json.loads(path.read_text())["keys"][1]["max_concurrent"] is None
    code, out, _ = keys_command(capsys, "list", "--file", str(path))
    assert code == 0 and "alice" in out and "bob" in out and key not in out and "1000" in out
    code, _, _ = keys_command(capsys, "remove", "alice", "--file", str(path))
    assert code == 0 and [k.name for k in load_api_keys(path).keys] == ["bob"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "alice"], "--file"),
        (["add", "bad name", "--file", "{file}"], "key name"),
        (["add", "alice", "--file", "{file}", "--rpm", "0"], "positive"),
        (["add", "taken", "--file", "{file}"], "already has"),
        (["list", "--file", "{missing}"], "cannot read"),
        (["list", "--file", "{broken}"], "not JSON"),
        (["remove", "nobody", "--file", "{file}"], "no key named"),
        ([], "required"),
    ],
)
def test_misuse_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    path, broken = tmp_path / "keys.json", tmp_path / "broken.json"
    broken.write_text("{")
    assert keys_command(capsys, "add", "taken", "--file", str(path))[0] == 0
    names = {"file": str(path), "missing": str(tmp_path / "missing.json"), "broken": str(broken)}
    code, _, err = keys_command(capsys, *[a.format(**names) for a in args])
    assert code == 2 and message in err, err
