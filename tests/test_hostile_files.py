"""Hostile input, round two (issue [robustness]), in the files a spec is or names: a spec file that is not
UTF-8 or is gigabytes long, a task data file that is gigabytes long or holds a row or cell too big or too
deeply nested, an image that is a decompression bomb, and a PASTA head map whose layer is not a number.
Each is run through the command line as a user types it: one ``error:`` line naming the file and the place
(line, byte, row, key), the limit and the fix, exit code 2, no traceback, and, where the file alone tells,
no run store created."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from fixtures.cli import cli, error_line

TASK = "{kind: repeated_tokens, n: 2, length: 4}"


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that takes no disk: ``head``, then a hole."""
    with path.open("wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


# --------------------------------------------------------------------------- the spec file
def test_a_spec_file_that_is_not_utf8_names_the_file_line_byte_and_the_fix(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = f'name: t\nmodel: headlab-tiny\ntask: {TASK}\nsteps:\n  - id: ind\n    detect: {{kind: induction}}\n'
    text += 'note: "café"\n'
    Path("latin.yaml").write_bytes(text.encode("latin-1"))
    offset = text.encode("latin-1").index(b"\xe9")
    for command in (["validate", "latin.yaml"], ["run", "latin.yaml", "--out", "runs"]):
        code, err = cli(command, capfd)
        line = error_line(err)
        assert code == 2, err
        assert line.startswith("error: latin.yaml:7:11: the file is not UTF-8"), line
        assert f"byte 0xe9 at byte offset {offset} (line 7, column 11)" in line and "save it as UTF-8" in line, line
    assert not Path("runs").exists()


def test_a_huge_spec_file_is_refused_by_its_size_before_it_is_read(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    size = 3 * 2**30  # 3 GiB, sparse: reading it whole was a MemoryError (exit 1)
    sparse(Path("big.yaml"), size, b"name: t\n")
    start = time.perf_counter()
    code, err = cli(["run", "big.yaml", "--out", "runs"], capfd)
    assert time.perf_counter() - start < 5
    line = error_line(err)
    assert code == 2, err
    assert line.startswith(f"error: big.yaml: the spec file is {size:,} bytes; the limit is 262,144 bytes "
                           "(MAX_SPEC_BYTES"), line
    assert not Path("runs").exists()
    assert cli(["validate", "big.yaml"], capfd)[0] == 2



# --------------------------------------------------------------------------- task data files
def data_spec(task: str, step: str = "generate: {max_new_tokens: 1}", model: str = "headlab-tiny") -> str:
    return f"name: t\nmodel: {model}\ntask: {task}\nsteps:\n  - id: st\n    {step}\n"


@pytest.mark.parametrize("name, task", [
    ("big.jsonl", "{kind: jsonl, path: big.jsonl, prompt: '{{ q }}'}"),
    ("big.csv", "{kind: csv, path: big.csv, prompt: '{{ q }}'}"),
])
def test_a_huge_data_file_is_refused_by_its_size_before_the_store(tmp_path, capfd, monkeypatch, name, task):
    monkeypatch.chdir(tmp_path)
    size = 5 * 2**30  # 5 GiB, sparse: it was read whole, then "OutOfMemory ... make the task smaller" after 45 s
    sparse(Path(name), size, b'{"q": "a b"}\n' if name.endswith(".jsonl") else b"q\na b\n")
    Path("s.yaml").write_text(data_spec(task))
    for command in (["run", "s.yaml", "--out", "runs"], ["validate", "s.yaml"]):
        start = time.perf_counter()
        code, err = cli(command, capfd)
        assert time.perf_counter() - start < 10
        line = error_line(err)
        assert code == 2, err
        assert line.startswith(f"error: s.yaml:3:{task.index('path') + 7}: task.path: {name.split('.')[1]} task: "
                               f"data file '{name}' is {size:,} bytes (5.0 GiB), over the limit of 1,073,741,824 "
                               "bytes (1.0 GiB) for a task's data file (MAX_DATA_FILE_BYTES)"), line
        assert "put the rows you use into a smaller file" in line, line
    assert not Path("runs").exists()


def test_a_row_too_long_is_refused_naming_the_file_row_and_limit(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pad = "word " * 2_000_001  # 10,000,005 characters, words of 4 letters
    long = json.dumps({"q": "c d", "pad": pad})
    Path("d.jsonl").write_text(json.dumps({"q": "a b"}) + "\n\n" + long + "\n")
    Path("s.yaml").write_text(data_spec("{kind: jsonl, path: d.jsonl, prompt: '{{ q }}'}"))
    code, err = cli(["run", "s.yaml", "--out", "runs"], capfd)
    line = error_line(err)
    assert code == 2, err
    assert "step 'st' (task 'jsonl'" in line, line
    assert (f"jsonl task: d.jsonl row 2 (line 3): the row is {len(long):,} characters long, over the limit of "
            "10,000,000 for one row (MAX_ROW_CHARS)") in line, line


def test_a_csv_cell_or_json_row_nested_too_deeply_names_the_row_and_limit(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    deep = "[" * 60_000 + "]" * 60_000  # under the csv module's field limit; json.loads overflowed (exit 1)
    Path("deep.csv").write_text(f'q,choices,label\nIs it?,"[""yes"", ""no""]",0\nDeep?,{deep},0\n')
    Path("s.yaml").write_text(data_spec("{kind: csv, path: deep.csv, prompt: '{{ q }}', choices: choices, "
                                        "label: label}", "score: {}"))
    code, err = cli(["run", "s.yaml", "--out", "runs"], capfd)
    line = error_line(err)
    assert code == 2, err
    assert ("csv task: deep.csv row 2 (line 3): choices field 'choices' is nested more than 64 levels deep, over the "
            "limit for data (MAX_DATA_DEPTH)") in line, line
    nested = '{"q": "c d", "x": ' + "[" * 5_000 + "]" * 5_000 + "}"  # json.loads reads it; ran unchecked
    Path("d.jsonl").write_text(json.dumps({"q": "a b"}) + "\n" + nested + "\n")
    Path("s.yaml").write_text(data_spec("{kind: jsonl, path: d.jsonl, prompt: '{{ q }}'}"))
    line = error_line(cli(["run", "s.yaml", "--out", "runs"], capfd)[1])
    assert "jsonl task: d.jsonl row 2: a value is nested more than 64 levels deep" in line, line
    # a list literal in a cell that is long but flat, and brackets inside quoted strings, are no nesting
    Path("deep.csv").write_text('q,choices,label\nIs it?,"[""[[[[yes"", ""no""]",0\n')
    Path("s.yaml").write_text(data_spec("{kind: csv, path: deep.csv, prompt: '{{ q }}', choices: choices, "
                                        "label: label}", "score: {}"))
    assert cli(["run", "s.yaml", "--out", "runs"], capfd)[0] == 0


# --------------------------------------------------------------------------- a decompression bomb
def png_header(path: Path, width: int, height: int) -> Path:
    """A PNG file whose header claims ``width x height`` pixels (its data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("width, height, pixels", [(50_000, 50_000, "2,500,000,000 pixels"),
                                                   (10_000, 10_000, "10,000 x 10,000 = 100,000,000 pixels")])
def test_a_decompression_bomb_names_the_image_the_row_and_the_limit(tmp_path, capfd, monkeypatch, width, height,
                                                                    pixels):
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (16, 16), "red").save("ok.png")
    png_header(Path("bomb.png"), width, height)
    rows = [{"q": "Red?", "img": "ok.png"}, {"q": "Red?", "img": "bomb.png"}]
    Path("v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("s.yaml").write_text(data_spec("{kind: jsonl, path: v.jsonl, prompt: '{{ q }}', image: img}",
                                        model="headlab-tiny-vlm"))
    code, err = cli(["run", "s.yaml", "--out", "runs"], capfd)
    line = error_line(err)
    assert code == 2, err  # was 1: DecompressionBombError from the action, no file or row named
    assert "step 'st' (task 'jsonl'" in line, line
    assert (f"jsonl task: v.jsonl row 2: image 'bomb.png' has {pixels}, over the limit of 89,478,485 pixels "
            "(MAX_IMAGE_PIXELS; a decompression bomb?); resize it") in line, line
    Path("v.jsonl").write_text(json.dumps(rows[0]) + "\n")  # the good row alone runs
    assert cli(["run", "s.yaml", "--out", "runs"], capfd)[0] == 0


# --------------------------------------------------------------------------- a PASTA head map
def pasta_spec(heads: str) -> str:
    return (f"name: t\nmodel: headlab-tiny\ntask: {{kind: emphasis, n: 2}}\nsteps:\n  - id: gen\n    generate:\n"
            f"      max_new_tokens: 1\n      steer: [{{kind: pasta, heads: {heads}}}]\n")


@pytest.mark.parametrize("heads, key, col", [('{"abc": [0]}', "abc", 37), ('{"1": [0], "x": [1]}', "x", 47),
                                             ('{"-1": [0]}', "-1", 37)])
def test_a_pasta_head_map_whose_layer_is_not_a_number_is_refused_when_validated(tmp_path, capfd, monkeypatch, heads,
                                                                                 key, col):
    monkeypatch.chdir(tmp_path)
    Path("p.yaml").write_text(pasta_spec(heads))
    for command in (["validate", "p.yaml"], ["run", "p.yaml", "--out", "runs"]):
        code, err = cli(command, capfd)
        line = error_line(err)
        assert code == 2, err
        assert line.startswith(f"error: p.yaml:8:{col}: steps[0].generate.steer[0].heads.{key}: layer key '{key}' "
                               "is not a layer number"), line
        assert 'a head map is {"<layer>": [heads]} with each layer written as a number 0 .. 2,147,483,647' in line
    assert not Path("runs").exists()  # refused before the store (it was a bare ValueError mid-run)
    Path("p.yaml").write_text(pasta_spec('{"1": [0], 2: [1]}'))  # digits, or a YAML integer key
    assert cli(["validate", "p.yaml"], capfd)[0] == 0
