"""The sparse video decode's keyframe seeking: the frames vlfast samples equal a sequential decode's, bit for
bit, on clips with B-frames, short closed GOPs, open GOPs, variable frame rate and an edit list; the seek is
taken where a keyframe starts a closed GOP, and never where it does not (open GOPs) or where the container
lands elsewhere than its index says (then the sequential decode gives the frames)."""

from __future__ import annotations

import struct
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from vlfast.pixels import video

av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def cfg():
    pytest.importorskip("transformers")
    from vlfast.pixels.engine import build_processor_config

    return build_processor_config("ref:qwen3-vl-2b", family="qwen3_vl", num_frames=8)


@pytest.fixture
def seeks(monkeypatch):
    """The offsets of every container seek the sparse decode makes."""
    made: list[int] = []
    seek = video._container_seek

    def counted(container, stream, offset):
        made.append(offset)
        seek(container, stream, offset)

    monkeypatch.setattr(video, "_container_seek", counted)
    return made


def _clip(path: Path, codec: str = "libx264", frames: int = 120, **options) -> Path:
    """A 64x48, 15 fps clip (8 s at 120 frames), or a skip where this PyAV build lacks the encoder."""
    from vlfast.demo import make_video

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} is not in this PyAV build")
    return make_video(path, frames=frames, fps=15, width=64, height=48, seed=7, codec=codec, options=options)


def _mux(path: Path, times: list[int], time_base: Fraction, shift: int = 0, **options) -> Path:
    """H.264 with B-frames (GOPs of 12) whose frames are shown at ``times`` (in ``time_base``), every packet
    moved ``shift`` earlier: frames shown before 0 are what an MP4 edit list then cuts."""
    from vlfast.demo import pattern

    if "libx264" not in av.codecs_available:
        pytest.skip("libx264 is not in this PyAV build")
    base = pattern(48, 128, 3)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=15)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.time_base = time_base
        stream.codec_context.time_base = time_base
        stream.options = {"g": "12", "bf": "2", **options}
        packets = []
        for i, t in enumerate(times):
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(base[:, i % 64 : i % 64 + 64]), format="rgb24"
            )
            frame.pts, frame.time_base = t, time_base
            packets += stream.encode(frame)
        packets += stream.encode()
        for packet in packets:
            packet.pts -= shift
            packet.dts -= shift
            container.mux(packet)
    return path


def _sequential(path: Path) -> list[np.ndarray]:
    """Every frame, as PyAV's plain decode gives them."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def _sparse(path: Path, indices: list[int]) -> list[np.ndarray] | None:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        packets = video._packet_pts(container, stream)
        return video._decode_sparse(container, stream, np.array(indices), packets)


def _assert_frames(got, full: list[np.ndarray], indices: list[int], what: str) -> None:
    assert got is not None, f"{what}: the sparse decode fell back"
    assert len(got) == len(indices)
    for k, frame in zip(indices, got):
        if not np.array_equal(frame, full[k]):
            diff = np.abs(frame.astype(int) - full[k].astype(int))
            raise AssertionError(
                f"{what}: frame {k} differs from the sequential decode's, by up to {diff.max()}"
            )


def _index_sets(n: int) -> list[list[int]]:
    return [
        [0, n - 1],
        [n - 1],
        [n // 2, n // 2 + 1],
        [5, 5, n - 3],  # repeats
        list(range(3, n, 13)),
        list(range(0, n, 7)),
        np.linspace(0, n - 1, 8).round().astype(int).tolist(),
    ]


@pytest.mark.parametrize(
    ("name", "codec", "options", "open_gop"),
    [
        ("gop12_b2.mp4", "libx264", {"g": "12", "bf": "2"}, False),  # closed GOPs, B-frames in a pyramid
        ("gop12_b3.mkv", "libx264", {"g": "12", "bf": "3"}, False),  # Matroska: seeks by pts, no frame count
        ("gop12_ionly.mp4", "libx264", {"g": "1"}, False),
        # open GOPs: each keyframe's leading B-frames are predicted from the GOP before
        ("open_gop.mp4", "libx264", {"bf": "3", "x264-params": "open-gop=1:keyint=12:scenecut=0"}, True),
        ("mpeg4_b.avi", "mpeg4", {"g": "12", "bf": "2"}, True),  # B-VOPs around each I-VOP; AVI seeks by dts
        ("mpeg4_b.mp4", "mpeg4", {"g": "12", "bf": "2"}, True),
        ("hevc.mp4", "libx265", {"x265-params": "log-level=none:keyint=12:min-keyint=12"}, True),  # CRA, RASL
    ],
)
def test_sparse_decode_with_seeks_equals_sequential(tmp_path, seeks, name, codec, options, open_gop):
    path = _clip(tmp_path / name, codec, **options)
    full = _sequential(path)
    with av.open(str(path)) as container:
        packets = video._packet_pts(container, container.streams.video[0])
    pts, keys = packets.pts, [i for i, key in enumerate(packets.key) if key]
    assert video._seek_points(packets) == keys  # no keyframe here has an earlier packet shown after it
    assert len(keys) >= 9, keys
    rank = {t: k for k, t in enumerate(sorted(pts))}
    # leading pictures: decoded after a keyframe, shown before it
    leading = {k: [rank[pts[i]] for i in range(k + 1, len(pts)) if pts[i] < pts[k]] for k in keys}
    opened = [k for k in keys if leading[k]]
    assert len(opened) >= 3 if open_gop else not opened, opened
    extra = [[rank[pts[k]], *leading[k]] for k in opened] + [sorted(sum(leading.values(), []))]
    for indices in _index_sets(len(full)) + [i for i in extra if i]:
        _assert_frames(_sparse(path, indices), full, indices, f"{name} {indices}")
    assert seeks, "GOPs of 12 frames: the decode must seek"
    offsets = {pts[k] for k in keys} | {packets.dts[k] for k in keys}
    assert set(seeks) <= offsets, "every seek goes to a keyframe's timestamp"
    for k in [k for k in opened if keys.index(k) >= 2][
        :2
    ]:  # a leading picture alone: from the keyframe before
        before = keys[keys.index(k) - 1]
        seeks.clear()
        _assert_frames(_sparse(path, leading[k][:1]), full, leading[k][:1], f"{name} leading picture")
        assert seeks and set(seeks) <= {pts[before], packets.dts[before]}, (seeks, pts[before], pts[k])


def test_read_video_seeks_and_equals_sequential(tmp_path, cfg, seeks):
    """read_video's sampled frames, for several frame counts, equal a sequential decode's at its indices."""
    path = _clip(tmp_path / "gops.mp4", frames=150, g="15", bf="2")
    full = _sequential(path)
    for n in (None, 2, 4, 16, 32):
        c = cfg if n is None else replace(cfg, num_frames=n)
        seeks.clear()
        frames, meta = video.read_video(str(path), c)
        assert meta["total_frames"] == len(full) == 150
        indices = meta["frame_indices"]
        _assert_frames(list(frames.permute(0, 2, 3, 1).numpy()), full, indices, f"num_frames={n}")
        if len(indices) <= 16:  # few frames in 10 GOPs: GOPs without one are skipped
            assert seeks, n


def test_variable_frame_rate(tmp_path, seeks):
    rng = np.random.default_rng(0)
    times = np.cumsum(rng.choice([20, 33, 34, 50, 67, 120], size=96)).tolist()
    path = _mux(tmp_path / "vfr.mp4", times, Fraction(1, 1000))
    with av.open(str(path)) as container:
        shown = sorted(p.pts for p in container.demux(video=0) if p.size)
    steps = set(np.diff(shown).tolist())
    assert len(steps) >= 4, f"the clip's frame durations are not variable: {steps}"
    full = _sequential(path)
    assert len(full) == 96
    for indices in _index_sets(len(full)):
        _assert_frames(_sparse(path, indices), full, indices, f"vfr {indices}")
    assert seeks


def _edit_lists(path: Path) -> list[tuple[int, int]]:
    """(segment duration, media time) of every entry of the file's 'elst' boxes (version 0)."""
    data = path.read_bytes()
    entries, at = [], data.find(b"elst")
    while at >= 0:
        version = data[at + 4]
        assert version == 0, "a version-1 edit list: this reader takes version 0"
        (count,) = struct.unpack(">I", data[at + 8 : at + 12])
        for i in range(count):
            duration, media_time = struct.unpack(">Ii", data[at + 12 + 12 * i : at + 20 + 12 * i])
            entries.append((duration, media_time))
        at = data.find(b"elst", at + 4)
    return entries


def test_edit_list(tmp_path, cfg, seeks):
    """An MP4 whose edit list starts three frames into the media: the first GOP's first frames are decoded
    as references and never shown, so a frame's index counts the shown frames only."""
    step = 1024  # 15 fps in MP4's 1/15360
    path = _mux(tmp_path / "elst.mp4", [i * step for i in range(60)], Fraction(1, 15360), shift=3 * step)
    assert any(media_time > 0 for _, media_time in _edit_lists(path)), _edit_lists(path)
    with av.open(str(path)) as container:
        packets = video._packet_pts(container, container.streams.video[0])
    assert sum(packets.discard) == 3
    full = _sequential(path)
    assert len(full) == 57
    for indices in _index_sets(len(full)):
        _assert_frames(_sparse(path, indices), full, indices, f"edit list {indices}")
    assert seeks
    frames, meta = video.read_video(str(path), cfg)  # samples by the container's 60 frames, then by 57
    _assert_frames(list(frames.permute(0, 2, 3, 1).numpy()), full, meta["frame_indices"], "read_video")


def test_a_seek_that_lands_elsewhere_falls_back(tmp_path, cfg, monkeypatch):
    """A container that lands past the keyframe asked for: the sparse decode gives up (None) and read_video's
    sequential decode gives the same frames; one that lands on an earlier seek point is decoded through."""
    path = _clip(tmp_path / "gops.mp4", g="12", bf="2")
    full = _sequential(path)
    seek = video._container_seek
    with av.open(str(path)) as container:
        packets = video._packet_pts(container, container.streams.video[0])
    last = max(t for t, key in zip(packets.pts, packets.key) if key)  # the last keyframe's pts

    monkeypatch.setattr(video, "_container_seek", lambda c, s, offset: seek(c, s, last))
    assert _sparse(path, [50, 60]) is None
    fallbacks = []
    decode_at = video._decode_at
    monkeypatch.setattr(video, "_decode_at", lambda *a, **k: fallbacks.append(a[2]) or decode_at(*a, **k))
    frames, meta = video.read_video(str(path), cfg)
    assert fallbacks, "the sequential decode was not taken"
    _assert_frames(list(frames.permute(0, 2, 3, 1).numpy()), full, meta["frame_indices"], "fallback")

    monkeypatch.setattr(video, "_container_seek", lambda c, s, offset: seek(c, s, 0))
    _assert_frames(_sparse(path, [50, 60, 100]), full, [50, 60, 100], "landed at the start")


def test_seek_points_follow_presentation_order():
    """A keyframe that an earlier packet is shown after is no seek point; a frame shown before the keyframe
    it is decoded after (a leading picture) is sought from the keyframe before."""
    # decode order; keyframes at positions 0, 3, 4 (followed by its leading pictures 4 and 5), 10 and 12
    # (pts 11, which packet 11, pts 13, is shown after)
    pts = [0, 2, 1, 3, 6, 4, 5, 9, 7, 8, 10, 13, 11, 12]
    key = [i in (0, 3, 4, 10, 12) for i in range(len(pts))]
    points = video._seek_points(video._Packets(pts, [None] * len(pts), key, [False] * len(pts)))
    assert points == [0, 3, 4, 10]
    assert [video._seek_point(points, pts, p) for p in range(len(pts))] == [
        0,
        0,
        0,
        3,
        4,
        3,
        3,
        4,
        4,
        4,
        10,
        10,
        10,
        10,
    ]
