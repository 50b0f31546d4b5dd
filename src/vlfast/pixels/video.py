"""Videos: the sampled frames decoded with PyAV, then resized, normalised and patchified by the rules of
the model's video processor (see :mod:`~vlfast.pixels.engine` for the rules and their proof)."""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import math
import platform
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlfast.pixels.media import MAX_ASPECT_RATIO, Media, SampleError, checked_media, read_failure
from vlfast.pixels.settings import VIDEO_RESAMPLES, ProcessorConfig
from vlfast.pixels.truncation import container_truncation

__all__ = [
    "empty_pixels",
    "normalize_patches",
    "patchify_video",
    "pixel_width",
    "fused_mean_std",
    "read_video",
    "rescale_normalize",
    "resize_frames",
    "sample_frame_indices",
    "smart_resize",
    "temporal_repeat",
    "video_resize_shape",
]


def sample_frame_indices(total: int, video_fps: float | None, cfg: ProcessorConfig) -> np.ndarray:
    """Which frames of a ``total``-frame video to keep, by the rule ``cfg.frame_sampling`` names."""
    if total < 1:
        raise SampleError("video has no frames")
    t = cfg.temporal_patch_size
    if cfg.frame_sampling == "qwen-vl-utils":
        # qwen_vl_utils.vision_process.smart_nframes (0.0.14), the indices its readers take
        n = _frame_count(total, video_fps, cfg, math.ceil(cfg.min_frames / t) * t)
        if not t <= n <= total:
            raise SampleError(f"cannot sample {n} frames from a {total}-frame video (rule qwen-vl-utils)")
        return torch.linspace(0, total - 1, n).round().long().numpy()
    if cfg.frame_sampling == "qwen3-vl":  # Qwen3VLVideoProcessor.sample_frames
        if (n := cfg.num_frames) is None:
            n = min(max(int(total / (video_fps or 24.0) * cfg.fps), cfg.min_frames), cfg.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(int)
    n = _frame_count(total, video_fps, cfg, cfg.min_frames)  # Qwen2VLVideoProcessor.sample_frames
    if n > total or n < 1:
        raise SampleError(f"cannot sample {n} frames from a {total}-frame video (rule qwen2-vl)")
    return torch.arange(0, total, total / n).int().numpy()


def _frame_count(total: int, video_fps: float | None, cfg: ProcessorConfig, min_frames: int) -> int:
    """The frames to sample, a multiple of the temporal patch: ``num_frames``, else ``fps`` over the video."""
    t = cfg.temporal_patch_size
    if cfg.num_frames is not None:
        return round(cfg.num_frames / t) * t
    rate = video_fps or 24.0
    max_frames = math.floor(min(cfg.max_frames, total) / t) * t
    n = min(max(total / rate * cfg.fps, min_frames), max_frames, total)
    return math.floor(n / t) * t


def smart_resize(
    height: int, width: int, factor: int, lo: float, hi: float, thin: str = "qwen-vl-utils"
) -> tuple[int, int]:
    """The ``smart_resize`` of one image or frame by ``thin``'s reference
    (:data:`~vlfast.pixels.settings.THIN_IMAGES`): "processor", transformers' Qwen2-VL image
    and video processors' (a side rounded to 0 patches, then the image scaled up to the minimum budget);
    "qwen-vl-utils", qwen-vl-utils' (that side first raised to one merged patch). They differ only where a
    side is at most half of ``factor`` (rounded to 0 patches)."""
    _check_aspect(height, width)
    least = factor if thin == "qwen-vl-utils" else 0
    h_bar = max(least, round(height / factor) * factor)
    w_bar = max(least, round(width / factor) * factor)
    return _within_budget(height, width, factor, h_bar, w_bar, lo, hi)


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise SampleError(f"video aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds 200:1")


def _within_budget(height, width, factor, h_bar, w_bar, lo, hi, frames: int = 1, t_bar: int = 1):
    """(h_bar, w_bar) scaled to keep ``t_bar * h_bar * w_bar`` pixels within [lo, hi] (``frames`` frames)."""
    if t_bar * h_bar * w_bar > hi:
        beta = math.sqrt((frames * height * width) / hi)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < lo:
        beta = math.sqrt(lo / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_resize_shape(num_frames: int, height: int, width: int, cfg: ProcessorConfig) -> tuple[int, int]:
    """(h, w) of every frame after resizing, by the rule ``cfg.video_sizing`` names:

    - ``"processor"``: ``Qwen3VLVideoProcessor.resize``, ``video_max_pixels`` a budget over all frames (with
      ``cap_pixels_per_frame``, each frame at most ``max_video_tokens`` patches' worth or an even share);
    - ``"qwen2-vl"``: ``Qwen2VLVideoProcessor.resize``, ``video_max_pixels`` a budget for each frame (with
      ``cap_pixels_per_frame``, also an even share of 90% of ``max_video_tokens`` patches' pixels, times the
      temporal patch, floored at 1.05 ``video_min_pixels``);
    - ``"qwen-vl-utils"``: qwen-vl-utils' ``fetch_video``: each frame within
      [video_min_pixels, max(min(max_video_tokens * factor**2, video_max_pixels / n * T), 1.05 * min)].
    """
    factor, tf = cfg.factor, cfg.temporal_patch_size
    if cfg.video_sizing == "qwen-vl-utils":
        lo = cfg.video_min_pixels
        frame_max = cfg.max_video_tokens * factor * factor
        hi = max(min(frame_max, cfg.video_max_pixels / num_frames * tf), int(lo * 1.05))
        return smart_resize(height, width, factor, lo, hi)
    if cfg.video_sizing == "qwen2-vl":
        hi = cfg.video_max_pixels
        if cfg.cap_pixels_per_frame:
            total = int(cfg.max_video_tokens * factor * factor * 0.9)
            hi = max(min(hi, total * tf // num_frames), int(cfg.video_min_pixels * 1.05))
        return smart_resize(height, width, factor, cfg.video_min_pixels, hi, cfg.thin_images)
    max_pixels = cfg.video_max_pixels
    if cfg.cap_pixels_per_frame:
        frame_cap = cfg.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, cfg.video_max_pixels // num_frames), int(cfg.video_min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    lo = cfg.video_min_pixels
    return _within_budget(height, width, factor, h_bar, w_bar, lo, max_pixels, num_frames, t_bar)


def resize_frames(frames: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """(T, 3, H, W) uint8 -> (T, 3, h, w) uint8 as torchvision's v2 ``resize`` (transformers' torchvision
    backend) computes it on CPU for PIL code ``resample``: bicubic (3) and, where ATen has its AVX2/AVX-512
    kernels, bilinear (2) on uint8 directly, antialiased; bilinear elsewhere in float32, rounded back; nearest
    (0: "nearest-exact") without antialiasing. The uint8 kernels are fastest on channels-last, as decoded."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    mode = VIDEO_RESAMPLES[resample]
    if mode == "nearest-exact":
        return F.interpolate(frames, size=size, mode=mode)
    arm = platform.machine() in ("aarch64", "arm64")
    if mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or arm:
        return F.interpolate(frames, size=size, mode=mode, align_corners=False, antialias=True)
    out = F.interpolate(frames.to(torch.float32), size=size, mode=mode, align_corners=False, antialias=True)
    return out.round_().to(torch.uint8)


def fused_mean_std(
    mean: tuple[float, ...],
    std: tuple[float, ...],
    rescale_factor: float,
    do_rescale: bool,
    shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 mean and std shaped ``shape``, divided by the rescale factor where both steps run: transformers'
    ``_fuse_mean_std_and_rescale_factor``, in float32 as it computes them (so the same bits)."""
    m = torch.tensor(mean, dtype=torch.float32).view(shape)
    s = torch.tensor(std, dtype=torch.float32).view(shape)
    if do_rescale:
        m, s = m * (1.0 / rescale_factor), s * (1.0 / rescale_factor)
    return m, s


def rescale_normalize(
    patches: torch.Tensor,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    rescale_factor: float,
    do_rescale: bool,
    do_normalize: bool,
    *,
    repeat: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 patches (N, C, L) -> float32 (N, C*repeat*L), on whatever device they are, as transformers'
    ``rescale_and_normalize``: with both steps ``(x - mean/r) / (std/r)`` per channel (its fused form),
    else ``x * r``, ``(x - mean) / std`` or ``x`` alone; each channel's L values written ``repeat`` times
    (an image's temporal patch: transformers repeats the normalised float32 patch). float32 subtraction,
    multiplication and division are exact IEEE operations, so any device gives the same bits.

    ``out``: a contiguous (N, C*repeat*L) floating tensor to write into instead, rounded to its dtype as
    ``.to(dtype)`` rounds transformers' pixel_values. On the CPU each block of up to 8 MB is normalised in a
    float32 block of its own, then copied into every temporal slot (normalising the first slot in place and
    copying it across took 1.2-1.7x as long beside four CPU-bound processes)."""
    n, c = patches.shape[:2]
    x = patches.reshape(n, c, 1, math.prod(patches.shape[2:]))
    width = x.shape[-1]
    if out is None:
        out = empty_pixels((n, c * repeat * width), torch.float32, patches.device)
    elif out.shape != (n, c * repeat * width) or not out.is_floating_point() or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous floating tensor of shape {(n, c * repeat * width)}, not "
            f"{out.dtype} {tuple(out.shape)}"
        )
    target = out.view(n, c, repeat, width)
    m = s = None
    if do_normalize:
        m, s = fused_mean_std(mean, std, rescale_factor, do_rescale, (1, c, 1, 1))
        m, s = m.to(patches.device), s.to(patches.device)
    direct = repeat == 1 and out.dtype == torch.float32  # the output is its own block
    step = n if patches.device.type != "cpu" else max(1, _CPU_BLOCK_BYTES // max(c * width * 4, 1))
    for i in range(0, n, step):
        rows = target[i : i + step]
        block = (
            rows if direct else empty_pixels((min(step, n - i), c, 1, width), torch.float32, patches.device)
        )
        block.copy_(x[i : i + step])  # then transformers' operations, in its order
        if do_normalize:
            block.sub_(m).div_(s)
        elif do_rescale:
            block.mul_(rescale_factor)
        if not direct:
            rows.copy_(block.expand(-1, -1, repeat, -1))
    return out


# float32 normalised per block on the CPU before it is copied into the output's temporal slots
_CPU_BLOCK_BYTES = 8 << 20
_HUGE_PAGE = 2 << 20


def empty_pixels(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor for pixel values; on Linux CPUs, one of 4 MB or more asks the kernel for transparent
    huge pages before it is first written (``madvise(MADV_HUGEPAGE)``, as torch's ``THP_MEM_ALLOC_ENABLE=1``):
    a 1080p image's 50 MB normalised in 31 ms instead of 87 (AMD EPYC, one thread)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if device.type == "cpu" and nbytes >= 2 * _HUGE_PAGE and _madvise is not None:
        start = (out.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        end = (out.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
        if end > start:
            _madvise(start, end - start, 14)  # MADV_HUGEPAGE; an error (EINVAL: no THP) changes nothing
    return out


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def normalize_patches(
    patches: torch.Tensor, cfg: ProcessorConfig, out: torch.Tensor | None = None, *, images: bool = False
) -> torch.Tensor:
    """uint8 patches (N, C, T*P*P), or an image's (N, C, P*P) each held once (given the temporal repeat) ->
    float32 pixel_values (N, C*T*P*P) by the video processor's rescale and normalisation, or with ``images``
    the image processor's. ``out``: written into instead, as :func:`rescale_normalize` says."""
    pre = "" if images else "video_"
    mean_std = (cfg.image_mean, cfg.image_std) if images else (cfg.video_mean, cfg.video_std)
    steps = [getattr(cfg, pre + k) for k in ("rescale_factor", "do_rescale", "do_normalize")]
    return rescale_normalize(patches, *mean_std, *steps, repeat=temporal_repeat(patches, cfg), out=out)


def pixel_width(patches: torch.Tensor, cfg: ProcessorConfig) -> int:
    """The width of the float pixel_values rows uint8 ``patches`` (N, C, L) normalise to: C*T*P*P."""
    return int(patches.shape[1]) * temporal_repeat(patches, cfg) * math.prod(patches.shape[2:])


def temporal_repeat(patches: torch.Tensor, cfg: ProcessorConfig) -> int:
    """How many times uint8 ``patches`` (N, C, L) are to be written in each row: T for an image's patches,
    each held once (L = P*P), 1 where the T frames are there (L = T*P*P)."""
    whole = cfg.temporal_patch_size * cfg.patch_size**2
    width = math.prod(patches.shape[2:])
    if width not in (whole, cfg.patch_size**2):
        raise ValueError(
            f"uint8 patches of {width} values a channel: expected {whole} or {cfg.patch_size**2}"
        )
    return whole // width


def patch_rows(frames: torch.Tensor, tp: int, p: int, m: int) -> torch.Tensor:
    """(T, 3, H, W) uint8, T a multiple of ``tp`` -> (rows, 3, tp*p*p) uint8 in the processors' patch order:
    rows (t, h/m, w/m, m, m), columns (C, T, P, P). One uint8 copy (two where channels-last)."""
    gt, gh, gw = frames.shape[0] // tp, frames.shape[-2] // p, frames.shape[-1] // p
    if frames.stride(1) == 1:  # channels-last, as decoded and resized
        # Two copies each reading runs of bytes that lie together (the whole patches, then each patch's
        # (cols, C) transposed in cache): one copy into (rows, C, cols) reads a byte every C, 1.4-1.8x slower
        hwc = frames.permute(0, 2, 3, 1).reshape(gt, tp, gh // m, m, p, gw // m, m, p, 3)
        order = hwc.permute(0, 2, 5, 3, 6, 1, 4, 7, 8).contiguous()
        return order.reshape(gt * gh * gw, -1, 3).transpose(1, 2).contiguous()
    x = frames.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3, tp * p * p)


def patchify_video(
    frames: torch.Tensor, cfg: ProcessorConfig, *, normalize: bool = True
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(T, 3, H, W) uint8 frames -> pixel_values (t*h*w, C*T*P*P) float32 and grid (t, h, w).

    Resize, rescale+normalise and patchify exactly as transformers' Qwen-VL video processors, in a cheaper
    order with bit-identical results: the patch permutation is done on uint8 before normalising, which is
    elementwise per channel and so commutes with it. With ``normalize=False`` the uint8 patches (N, C,
    T*P*P) are returned for :func:`normalize_patches` to finish later (4x fewer bytes to move).
    """
    n = frames.shape[0]
    # smart_resize refuses fewer frames than the temporal patch; a one-frame clip is treated as the
    # processor treats an image: the frame repeated.
    h, w = video_resize_shape(max(n, cfg.temporal_patch_size), frames.shape[-2], frames.shape[-1], cfg)
    if not cfg.video_do_resize:  # as transformers without resizing: the frames must be whole patches already
        h, w = frames.shape[-2:]
        if h % cfg.factor or w % cfg.factor:
            raise SampleError(
                f"frames of {w}x{h} are not multiples of {cfg.factor} (patch x merge), and the video processor's "
                "do_resize is false: resize the video, or set do_resize in the checkpoint's video processor settings"
            )
    elif (h, w) != tuple(frames.shape[-2:]) and cfg.video_sizing == "qwen-vl-utils":
        # qwen-vl-utils resizes with torchvision's v1 ``resize``: on uint8 it casts to float32, interpolates,
        # clamps, rounds and casts back (a level off here and there from the uint8 kernel).
        frames = F.interpolate(
            frames.to(torch.float32), size=(h, w), mode="bicubic", align_corners=False, antialias=True
        )
        frames = frames.clamp_(0, 255).round_().to(torch.uint8)
    else:
        frames = resize_frames(frames, (h, w), cfg.video_resample)
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -n % tp:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)), dim=0)
    gt, gh, gw = frames.shape[0] // tp, h // p, w // p
    patches = patch_rows(frames, tp, p, m)
    return (normalize_patches(patches, cfg) if normalize else patches), (gt, gh, gw)


def _video_failure(path: Media, size: int, reason: str, *, cut: bool = False) -> SampleError:
    """The SampleError for a video that failed with ``reason``: "truncated or corrupt video" when the file
    is shorter than its own container says, or when ``cut`` says the failure looks like it (the end of the
    file met while opening, a failure after the container opened); otherwise ``reason`` as it is."""
    where = container_truncation(path, size)
    if where is not None:
        reason, cut = f"{where} ({reason})", True
    return SampleError(f"truncated or corrupt video: {reason}" if cut else reason)


@dataclass(frozen=True)
class _Packets:
    """The video stream's packets in decode order, as the demuxer gives them: timestamps (``stream.time_base``;
    None where the container has none), keyframe flags, and the packets an edit list cuts (never shown)."""

    pts: list[int | None]
    dts: list[int | None]
    key: list[bool]
    discard: list[bool]

    def __len__(self) -> int:
        return len(self.pts)

    @classmethod
    def of(cls, pts: list[int | None]) -> _Packets:
        """Timestamps alone: no keyframe known, so nothing to seek to."""
        return cls(list(pts), [None] * len(pts), [False] * len(pts), [False] * len(pts))


def _packet_pts(container, stream, *, rewind: bool = True) -> _Packets:
    """The stream's packets' timestamps and flags in decode order, read without decoding anything."""
    rows = [(p.pts, p.dts, p.is_keyframe, p.is_discard) for p in container.demux(stream) if p.size > 0]
    if rewind:
        container.seek(0)
    return _Packets(*map(list, zip(*rows))) if rows else _Packets.of([])


# What PyAV raises for data it cannot read: FFmpegError (InvalidDataError is also a ValueError, EOFError
# an EOFError), and OSError, ValueError, IndexError, EOFError, RuntimeError from its Python layer.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, IndexError, EOFError, RuntimeError)


def read_video(path: Media, cfg: ProcessorConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """Decode the sampled frames of a video (a file, or a media object) with PyAV: (T, 3, H, W) uint8 and
    sampling metadata."""
    import av

    size = checked_media(path)
    step = None  # what was being done when it failed; None: opening the container
    try:
        with contextlib.ExitStack() as files:
            source = str(path) if isinstance(path, str) else files.enter_context(path.open())
            container = files.enter_context(av.open(source))
            if not container.streams.video:
                raise SampleError(f"no video stream in {path}")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            video_fps = float(rate) if rate else None
            step = "reading its packets"
            pts = _packet_pts(container, stream, rewind=False)
            if not pts:  # a stream header and no packet: seeking in it fails with an OS error saying nothing
                raise SampleError(f"video has no frames: its video stream holds no packets ({path})")
            step = "seeking back to its start"
            container.seek(0)
            # The container's own count, as transformers' read_video_pyav samples by; containers without
            # one (webm, some mkv) are counted by packets.
            total = int(stream.frames or 0) or len(pts)
            indices = sample_frame_indices(total, video_fps, cfg)
            step = "decoding it"
            turn = cfg.video_rotation
            frames = _decode_sparse(container, stream, indices, pts, turn=turn)
            if frames is None:  # timestamps unusable, or a frame did not come back: decode them all
                container.seek(0)
                frames = _decode_at(container, stream, indices, turn=turn)
            if len(frames) < len(indices):
                # The container promised more frames than decode: re-sample over those that exist.
                container.seek(0)
                all_frames = _decode_at(container, stream, None, turn=turn)
                if not all_frames:
                    raise SampleError(f"no decodable frames in {path}")
                total = len(all_frames)
                indices = sample_frame_indices(total, video_fps, cfg)
                frames = [all_frames[i] for i in indices]
    except SampleError as e:
        raise _video_failure(path, size, str(e)) from None
    except (av.error.FFmpegError, *_DECODE_ERRORS) as e:
        failure = read_failure(path, e)
        if failure is not None:  # the store failed mid-stream, not the video
            raise failure from e
        if step is None and not isinstance(e, EOFError):  # not a container FFmpeg can open
            raise _video_failure(path, size, f"unreadable or corrupt video: {e}") from None
        raise _video_failure(path, size, f"{step or 'opening it'} failed: {e}", cut=True) from None
    if not frames:
        raise _video_failure(path, size, f"no decodable frames in {path}")
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)  # (T, 3, H, W), channels-last strides
    return video, {"video_fps": video_fps, "total_frames": total, "frame_indices": indices.tolist()}


def _collect(
    frames,
    seek: list[int | None],
    rank: dict[int, int],
    wanted: set[int],
    got: dict[int, np.ndarray],
    turn: bool,
    reformatter,
) -> bool:
    """The wanted frames among ``frames`` into ``got`` (by index). ``seek``, after a seek: the keyframe's pts
    and the first frame's (None where an edit list cuts it), cleared at the first frame shown from the
    keyframe on. False where the decode cannot be trusted."""
    for frame in frames:
        low, expect = seek
        if low is not None:  # the first frames after a seek
            if frame.pts is None:
                return False
            if frame.pts < low:
                continue  # a leading picture of the keyframe sought to, predicted from before it
            if expect is not None and frame.pts != expect:
                return False
            seek[:] = [None, None]
        k = rank.get(frame.pts)
        if k in wanted and k not in got:
            got[k] = _rgb(frame, turn, reformatter)
    return True


def _decode_sparse(
    container, stream, indices: np.ndarray, packets: _Packets | list[int | None], *, turn: bool = False
) -> list[np.ndarray] | None:
    """RGB frames at ``indices`` without decoding the frames nothing refers to; None to fall back.

    A frame's index is its rank in presentation order among the frames shown, which the packets' timestamps
    give before any decoding. When every frame still wanted lies at or past a keyframe the decode has not
    reached (:func:`_seek_points`), the container seeks to it and the GOPs between are never read. Packets of
    unwanted frames are sent with ``skip_frame = NONREF``: the decoder drops them only if no other frame is
    predicted from them. So each wanted frame decodes from exactly the references it would in a full
    decode, bit for bit. None when timestamps are missing or repeated, a seek goes wrong, or a frame is missing.
    """
    if not isinstance(packets, _Packets):
        packets = _Packets.of(packets)
    pts = packets.pts
    if not pts or None in pts or len(set(pts)) != len(pts):
        return None
    shown = sorted(t for t, cut in zip(pts, packets.discard) if not cut)
    rank = {t: k for k, t in enumerate(shown)}
    wanted = set(indices.tolist())
    if not wanted or min(wanted) < 0 or max(wanted) >= len(shown):
        return None  # a frame that cannot come back
    at = {t: i for i, t in enumerate(pts)}  # decode-order position of each packet
    points = _seek_points(packets)
    # (seek point, index) of each wanted frame: the position of the keyframe a decode for it may start at
    plan = sorted((_seek_point(points, pts, at[shown[k]]), k) for k in wanted)
    head, tried = 0, set()
    got: dict[int, np.ndarray] = {}
    reformatter = _reformatter()
    ctx = stream.codec_context
    demux = container.demux(stream)
    pos = 0  # decode-order position of the next packet
    # after a seek: the keyframe's pts, and the first frame's (_collect)
    seek: list[int | None] = [None, None]
    try:
        while len(got) < len(wanted):
            packet = next(demux, None)
            if packet is None:
                break
            if packet.size == 0:  # the final flush packet: no timestamp, keeps the last setting
                frames = ctx.decode(packet)
            else:
                while plan[head][1] in got:
                    head += 1
                target = plan[head][0]
                if target > pos and target not in tried:
                    # Nothing wanted lies before the target, nor waits in the decoder (its packet would be
                    # before pos): skip the GOPs between.
                    tried.add(target)
                    landed = _seek(container, stream, packets, target, at, points)
                    if landed is None:
                        return None
                    demux, packet, pos = landed
                    seek[:] = [pts[pos], None if packets.discard[pos] else pts[pos]]
                if pos >= len(pts) or packet.pts != pts[pos]:
                    return None  # the demuxer and the index disagree
                keep = rank.get(packet.pts) in wanted or packets.key[pos]
                ctx.skip_frame = "DEFAULT" if keep else "NONREF"
                frames = ctx.decode(packet)
                pos += 1
            if not _collect(frames, seek, rank, wanted, got, turn, reformatter):
                return None
    finally:
        ctx.skip_frame = "DEFAULT"
    if len(got) < len(wanted):
        return None
    return [got[k] for k in indices.tolist()]


def _seek_points(packets: _Packets) -> list[int]:
    """Decode-order positions of the keyframes a decode can start from: position 0, and each keyframe that
    every earlier packet precedes in presentation. A decode started there gives every later frame shown
    from the keyframe on as a sequential decode does; the leading pictures of an open GOP are shown before
    it and left to the keyframe before (:func:`_seek_point`)."""
    pts = packets.pts
    points, prefix_max = [0], pts[0]
    for i in range(1, len(pts)):
        if packets.key[i] and prefix_max < pts[i]:
            points.append(i)
        prefix_max = max(prefix_max, pts[i])
    return points


def _seek_point(points: list[int], pts: list[int], p: int) -> int:
    """The seek point for the frame whose packet is at position ``p``: the last one at or before it that
    the frame is not a leading picture of (shown before it)."""
    j = bisect.bisect_right(points, p) - 1
    while j > 0 and pts[points[j]] > pts[p]:
        j -= 1
    return points[j]


def _seek(container, stream, packets: _Packets, target: int, at: dict[int, int], points: list[int]):
    """Seek to the keyframe at decode-order position ``target``: (demuxer, its first packet, that packet's
    position), or None where the container lands after the target or off the seek points. The offset is
    the keyframe's pts, then its dts: MP4 and Matroska seek by pts, AVI by dts; landing on an earlier seek
    point is fine."""
    import av

    clean = set(points)
    for offset in dict.fromkeys((packets.pts[target], packets.dts[target])):
        if offset is None:
            continue
        try:
            _container_seek(container, stream, offset)
            demux = container.demux(stream)
            first = next((p for p in demux if p.size > 0), None)
        except (av.error.FFmpegError, *_DECODE_ERRORS):
            return None
        if first is None:
            return None
        landed = at.get(first.pts)
        if landed is not None and landed <= target and landed in clean:
            stream.codec_context.flush_buffers()  # container.seek flushes it too (PyAV 14-18); be sure
            return demux, first, landed
    return None


def _container_seek(container, stream, offset: int) -> None:
    """The container's seek to the keyframe at or before ``offset``; a seam for tests to count seeks."""
    container.seek(offset, stream=stream, backward=True, any_frame=False)


def _decode_at(container, stream, indices: np.ndarray | None, *, turn: bool = False) -> list[np.ndarray]:
    """RGB frames at ``indices`` (repeats allowed) in one sequential decode; all frames when None."""
    wanted = None if indices is None else collections.Counter(indices.tolist())
    last = None if wanted is None else max(wanted)
    out: list[np.ndarray] = []
    reformatter = _reformatter()
    for i, frame in enumerate(container.decode(stream)):
        if wanted is None or i in wanted:
            out.extend([_rgb(frame, turn, reformatter)] * (1 if wanted is None else wanted[i]))
        if last is not None and i >= last:
            break
    return out


def _reformatter():
    """One decode's frame converter, freed when the decode returns. Not ``frame.to_ndarray(format=...)``: that
    keeps a converter on each frame, and its swscale slice threads with it, until the frame is freed, which
    reading the display matrix leaves to the garbage collector (the frame and its side data refer to each
    other); a DataLoader worker forked before that collection hangs freeing it. One per decode, not per frame,
    also keeps its swscale context: 0.32 ms a 720p frame, where a new one per frame took 0.5-0.6 (2-core
    EPYC)."""
    from av.video.reformatter import VideoReformatter

    return VideoReformatter()


def _rgb(frame, turn: bool, reformatter) -> np.ndarray:
    """A decoded frame as (H, W, 3) uint8, turned upright by its display matrix where ``turn`` (a view with
    other strides: the caller's np.stack makes the clip contiguous)."""
    rgb = reformatter.reformat(frame, format="rgb24").to_ndarray()
    return np.rot90(rgb, display_turns(frame)) if turn else rgb


def display_turns(frame) -> int:
    """Quarter turns counter-clockwise (``np.rot90``'s k) that make a decoded frame upright by its display
    matrix (FFmpeg's ``av_display_rotation_get``, read from the matrix itself), as torchcodec turns the frames
    transformers' video processors decode (checked against torchcodec 0.17). A mirrored or a non-right-angle
    matrix raises SampleError: torchcodec's turn for it is not known here."""
    for side in list(frame.side_data.keys()) if hasattr(frame.side_data, "keys") else list(frame.side_data):
        if "DISPLAYMATRIX" not in str(getattr(side, "type", "")):
            continue
        m = struct.unpack("<9i", bytes(side))
        sx, sy = math.hypot(m[0], m[3]), math.hypot(m[1], m[4])
        if not sx or not sy:
            return 0  # a degenerate matrix: FFmpeg reads no rotation from it
        if m[0] * m[4] - m[1] * m[3] < 0:
            raise SampleError("the video's display matrix mirrors its frames: vlfast turns frames only")
        angle = -math.degrees(math.atan2(m[1] / sy, m[0] / sx))
        turns = round(angle / 90)
        if abs(angle - 90 * turns) > 1e-6:
            raise SampleError(
                f"the video's display matrix rotates its frames by {angle:.1f} degrees: vlfast turns frames by "
                "right angles only"
            )
        return turns % 4
    return 0
