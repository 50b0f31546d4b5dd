"""Inputs: folder scans, manifests in three formats, frame lists, duplicate ids."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlfast.extraction.inputs import Sample, dedupe, read_inputs, read_manifest, scan_folder


def _touch(p, data=b"x"):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_scan_folder_recursive_sorted_media_only(tmp_path):
    for name in ["b.jpg", "a/c.PNG", "a/v.mp4", "notes.txt", ".hidden/x.jpg", "a/.y.jpg"]:
        _touch(tmp_path / name)
    samples = scan_folder(tmp_path)
    assert [s.id for s in samples] == ["a/c.PNG", "a/v.mp4", "b.jpg"]
    assert [s.kind for s in samples] == ["image", "video", "image"]


def test_manifests_jsonl_csv_parquet_agree(tmp_path):
    rows = [
        {"id": "one", "path": "img/1.jpg", "prompt": "What is this?"},
        {"id": "clip", "path": ["f/0.png", "f/1.png", "f/2.png"]},
        {"id": "vid", "path": "v.mp4"},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    csv_rows = [
        "id,path,prompt",
        "one,img/1.jpg,What is this?",
        'clip,"[""f/0.png"", ""f/1.png"", ""f/2.png""]",',
        "vid,v.mp4,",
    ]
    (tmp_path / "m.csv").write_text("\n".join(csv_rows) + "\n")
    pq.write_table(
        pa.table(
            {
                "id": [r["id"] for r in rows],
                "path": [json.dumps(r["path"]) if isinstance(r["path"], list) else r["path"] for r in rows],
                "prompt": [r.get("prompt") for r in rows],
            }
        ),
        tmp_path / "m.parquet",
    )
    got = [read_manifest(tmp_path / f"m.{ext}") for ext in ("jsonl", "csv", "parquet")]
    assert got[0] == got[1] == got[2]
    one, clip, vid = got[0]
    assert one == Sample("one", "image", (str(tmp_path / "img/1.jpg"),), "What is this?")
    assert clip.kind == "frames" and len(clip.paths) == 3
    assert vid.kind == "video" and vid.prompt is None


def test_manifest_id_defaults_to_path_and_errors_name_the_row(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"path": "a.jpg"}\n{"id": "x"}\n')
    with pytest.raises(ValueError, match="row 2: no 'path'"):
        read_manifest(tmp_path / "m.jsonl")
    (tmp_path / "n.jsonl").write_text('{"path": "a.jpg"}\nnot json\n')
    with pytest.raises(ValueError, match="n.jsonl:2"):
        read_manifest(tmp_path / "n.jsonl")
    (tmp_path / "o.jsonl").write_text('{"path": "/abs/a.jpg"}\n')
    assert read_manifest(tmp_path / "o.jsonl")[0].id == "/abs/a.jpg"


def test_dedupe_keeps_first_and_reports_the_rest():
    s = [Sample("a", "image", ("1.jpg",)), Sample("b", "image", ("2.jpg",)), Sample("a", "image", ("3.jpg",))]
    kept, dups = dedupe(s)
    assert [k.paths[0] for k in kept] == ["1.jpg", "2.jpg"]
    assert len(dups) == 1 and dups[0].source == "3.jpg" and "1.jpg" in dups[0].reason


def test_read_inputs_rejects_unknown(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        read_inputs(tmp_path / "missing")
    with pytest.raises(ValueError, match="kind"):
        Sample("x", "audio", ("a.wav",))  # type: ignore[arg-type]
