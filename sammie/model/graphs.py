"""GraphedDetector: the detector's two hot stages compiled and captured as CUDA graphs, one per batch bucket.

    encode_images(pixels [B, 3, S, S])   B in image_buckets  -> one graph per B  (the ViT: ~96% of the FLOPs)
    encode_prompts(token_ids [U, L])     eager passthrough (variable prompt counts; cached per string upstream)
    ground(images, prompts, image_index [P], prompt_index [P])  P in pair_buckets -> one graph per P

Why: at serving batch sizes the grounding stage is launch-bound (a few thousand small kernels per batch; at batch 1
~6 TFLOP/s effective, see ../shared/design/sam3-reference.md section 12), and the ViT's kernels are many too. A
captured graph replays all of a stage's kernels with one launch and no Python in between.

How each stage is made graphable:
- fixed shapes per bucket. `encode_images` takes only B in `image_buckets` (the engine pads to a bucket).
  `ground` sees a varying number of distinct images and prompts per batch, so the gather that maps pairs to their
  image and prompt rows runs OUTSIDE the graph, straight into static per-pair buffers (`index_select(out=...)`,
  or for image rows given by a host index, one copy per run of rows adjacent in memory: `copy_rows`):
  fpn levels [P, d, h, w], geometry token [P, 1, d], text [P, L, d], text padding [P, L]. The captured function is
  `detector.ground(gathered images, gathered prompts, arange(P), arange(P))`, which depends on P only.
  Equivalence: `ground` reads the per-image and per-prompt tensors only through `index_select(0, index)` (text,
  padding, geometry and fpn[-1] in `Sam3Detector.ground`; fpn[0], fpn[1] in `MaskHead`'s pixel decoder). Gathering
  first with the same index and then selecting with arange gives bit-identical [P, ...] inputs to every later op
  (index_select only copies), so the result equals the eager call at the same P exactly.
- static buffers sized for the largest bucket, shared by a stage's buckets (bucket P uses rows [:P]); inputs are
  copied in before each replay and outputs cloned out after it: the engine keeps image features alive across
  later grounding batches, and a stage's graphs share one memory pool, so a graph's output memory may be another
  bucket's scratch space.
- position encodings are input independent: `encode_images` returns one persistent copy (the same tensors every
  call, as the eager backbone returns its buffers); `ground` copies the caller's `pos` into its static buffers only
  when they are not the tensors it copied last time.
- no host syncs in the captured regions (the detector traces with `fullgraph=True`: no `.item()`, `nonzero` or
  data-dependent shapes). On the hot path outside them: shape checks (host metadata), the gathers, one replay, the
  clones. Index lists from the host are copied with one pinned, non-blocking host->device copy.

Why explicit `torch.cuda.CUDAGraph` capture and not `torch.compile(mode="reduce-overhead")` (cudagraph trees):
- the engine runs the IMAGE and GROUNDING stages on two worker threads; cudagraph trees keep their tree manager in
  thread-local state and assume one thread records and replays a tree, which is not a documented guarantee;
- trees record lazily on the first calls of each shape (during traffic unless warm-up hits every bucket just so),
  and their outputs are overwritten by the next replay unless the caller clones or marks steps;
- here capture happens in `capture()`, once, before traffic, per bucket, largest first, into one memory pool per
  stage; a per-stage lock makes copy-in / replay / clone-out of one call atomic with respect to other callers;
  `stats()` reports what was captured and replayed.
So the model is compiled with inductor WITHOUT its cudagraphs (`triton.cudagraphs=False`, `dynamic=False`,
`fullgraph=True`) and the compiled function is captured by hand. `compile_mode=None` captures the eager model
(no inductor: fast to start, still removes the launch overhead).

Recompiles: every graph the compiler builds goes through a counting backend; a compile after `capture()` is a
recompile, counted in `stats()["recompiles"]` (and raised with `fail_on_recompile=True`). With CUDA graphs the
steady state never enters the compiled function at all (replays only); without them (CPU) it must hit its cache.

Streams: capture runs on a side stream, one per stage (CUDA requires a non-default capture stream; a captured cuBLAS
call keeps its capture stream's workspace, and the engine replays the two stages concurrently); replays run on the
caller's current stream (the engine's two stages: a stream each with `stage_streams`, else both on the default
stream). A stage remembers the stream of its last call and makes a call from another stream wait for it, so its static
buffers are never rewritten under a running replay.
`capture()` must run before any other thread issues CUDA work (the capture mode is global).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo  # torch._dynamo.config is read in capture(); not imported by `import torch` alone

from sammie.model.detector import Grounding, ImageFeatures, PromptFeatures, Sam3Detector

log = logging.getLogger(__name__)

# inductor modes that turn on inductor's own CUDA graphs; we capture ourselves, so they are refused
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# Iterations of each bucket before capture (PyTorch's CUDA graph notes use a few on a side stream: lazy
# initialisation, cuDNN/cuBLAS heuristics and inductor's autotuning must not happen inside the capture).
_WARMUP_ITERS = 3


# --------------------------------------------------------------------------------------------------------------
# The two captured stage functions (module level: torch.compile caches per code object)


def _encode_images_stage(detector: Sam3Detector, pixels: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    feats = detector.encode_images(pixels)
    return feats.fpn, feats.geometry  # pos is input independent: kept once outside (see GraphedDetector._pos)


def _ground_stage(
    detector: Sam3Detector,
    fpn: list[torch.Tensor],  # per-pair levels [P, d, h, w], already gathered by image_index
    pos: list[torch.Tensor],  # [1, d, h, w] per level
    geometry: torch.Tensor,  # [P, 1, d]
    text: torch.Tensor,  # [P, L, d], already gathered by prompt_index
    padding: torch.Tensor,  # [P, L] bool
) -> Grounding:
    index = torch.arange(text.shape[0], device=text.device)  # pair n reads row n: a constant under compile
    return detector.ground(ImageFeatures(fpn, pos, geometry), PromptFeatures(text, padding), index, index)


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` is the row right after `a` in one tensor's memory (both [1, ...] views of the same layout)."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.stride(0))


def copy_rows(dst: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
    """dst[j] = rows[j][0] for j < len(rows) (each [1, ...]), one copy per run of rows adjacent in memory.

    The pairs of a grounding batch mostly read consecutive rows of one image batch ([8, 256, 288, 288] bf16 is
    340 MB), so a run is one strided view and one copy kernel, against a concatenation plus `index_select` (its
    small-index kernel took ~0.8 ms a call on the H200, waterfall run 14). Rows out of order, repeated (padding)
    or from other tensors start a new run. Only copies, so the result equals `index_select` exactly.
    """
    if any(r.shape[0] != 1 for r in rows):
        raise ValueError(f"copy_rows: rows must be [1, ...] each, got batch dims {[r.shape[0] for r in rows]}")
    for start, end in adjacent_runs(rows):
        first = rows[start]
        span = first.as_strided((end - start, *first.shape[1:]), first.stride(), first.storage_offset())
        dst[start:end].copy_(span)


def adjacent_runs(rows: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `rows` that are consecutive rows of one tensor's memory."""
    runs, start = [], 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and _follows(rows[end - 1], rows[end]):
            end += 1
        runs.append((start, end))
        start = end
    return runs


# --------------------------------------------------------------------------------------------------------------
# Compilation with a compile counter


class _CountingBackend:
    """torch.compile backends that count the graphs they compile, then hand them to inductor or a named backend.

    `for_mode(mode)` is the backend of one stage (its inductor mode); all of them count here. `sealed` is set once
    capture is done: any compile after that is a recompile."""

    def __init__(self, backend: str, fail_on_recompile: bool):
        self.backend, self.fail_on_recompile = backend, fail_on_recompile
        self.compiles = 0
        self.recompiles = 0
        self.sealed = False

    def for_mode(self, compile_mode: str) -> Callable[..., Any]:
        return functools.partial(self._compile, compile_mode)

    def _compile(self, compile_mode: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        if self.sealed:
            self.recompiles += 1
            shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)][:4]
            log.warning("GraphedDetector: recompile in steady state (inputs %s ...)", shapes)
            if self.fail_on_recompile:
                raise RuntimeError(f"GraphedDetector: recompile after capture() (inputs {shapes} ...)")
        if self.backend == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = {**list_mode_options(compile_mode), "triton.cudagraphs": False}
            return compile_fx(gm, example_inputs, config_patches=patches)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


# --------------------------------------------------------------------------------------------------------------
# One stage: its buckets, static buffers, graphs and counters


@dataclass
class _Stage:
    name: str
    buckets: tuple[int, ...]  # sorted ascending
    run: Callable[..., Any]  # compiled (or eager) stage function
    lock: threading.Lock = field(default_factory=threading.Lock)
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)  # static outputs of each captured graph
    replays: dict[int, int] = field(default_factory=dict)  # calls per bucket after capture
    capture_s: dict[int, float] = field(default_factory=dict)  # compile + warm-up + capture, per bucket
    pool: Any = None  # CUDA graph memory pool shared by this stage's graphs
    last_stream: Any = None  # stream of the previous call (see module docstring, Streams)
    # the side stream every graph of this stage is captured on: a captured cuBLAS call keeps the workspace of its
    # capture stream, so the two stages' graphs, which the engine replays concurrently on two streams
    # (`EngineConfig.stage_streams`), must not have been captured on one stream (PyTorch's pool hands out 32 per
    # priority, round robin: a stream per bucket could repeat)
    capture_stream: Any = None

    def check_bucket(self, n: int, what: str) -> None:
        if n not in self.buckets:
            raise ValueError(f"GraphedDetector.{self.name}: {what} {n} is not a captured bucket {list(self.buckets)}; "
                             f"pad the batch to a bucket size")


def _bucket_list(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(int(b) for b in buckets)))
    if not out or out[0] < 1:
        raise ValueError(f"{name} must be a non-empty list of positive batch sizes, got {list(buckets)}")
    return out


class GraphedDetector:
    """Wraps a `Sam3Detector` (eval mode, weights final) with per-bucket compiled + CUDA-graphed stages.

    Same call interface as the detector's three stages; call `capture()` once before traffic. See the module
    docstring for the design. Thread safety: each stage may be called from any thread; one call of a stage runs at a
    time (a per-stage lock), the two stages run concurrently.

    Args:
        detector: the wrapped model (not copied; its weights must not change after `capture()`).
        image_buckets: batch sizes `encode_images` accepts (the engine's image buckets).
        pair_buckets: pair counts `ground` accepts (the engine's pair buckets).
        compile_mode: an inductor mode ("default", "max-autotune-no-cudagraphs", ...) or None for no torch.compile.
        image_compile_mode: the image stage's inductor mode when it differs from `compile_mode` (None: the same).
            max-autotune benchmarks Triton GEMM templates against cuBLAS per shape and can fuse an epilogue (the
            ViT's GELU) into a winning template; it compiles for minutes, so it may be wanted for the ViT alone.
        backend: "inductor" or any torch.compile backend name (tests use "aot_eager": dynamo + AOTAutograd, no codegen).
        cuda_graphs: capture CUDA graphs; None -> when the detector is on a CUDA device. False runs the compiled
            function directly (CPU), still through the static buffers.
        fail_on_recompile: raise instead of only counting when something compiles after `capture()`.
    """

    def __init__(
        self,
        detector: Sam3Detector,
        image_buckets: Sequence[int],
        pair_buckets: Sequence[int],
        *,
        compile_mode: str | None = "default",
        image_compile_mode: str | None = None,
        backend: str = "inductor",
        cuda_graphs: bool | None = None,
        fail_on_recompile: bool = False,
    ):
        param = next(detector.parameters())
        self.detector = detector
        self.device, self.dtype = param.device, param.dtype
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the detector on a CUDA device, it is on {self.device}")
        if image_compile_mode is not None and compile_mode is None:
            raise ValueError(f"image_compile_mode {image_compile_mode!r} needs a compile_mode (None: no torch.compile)")
        image_compile_mode = image_compile_mode or compile_mode
        for name, mode in (("compile_mode", compile_mode), ("image_compile_mode", image_compile_mode)):
            if mode in _CUDAGRAPH_MODES:
                raise ValueError(f"{name} {mode!r} turns on inductor's own CUDA graphs; GraphedDetector captures its "
                                 f"own: use 'default' or 'max-autotune-no-cudagraphs'")
            if mode is not None and backend != "inductor" and mode != "default":
                raise ValueError(f"{name} {mode!r} applies to backend='inductor' only, not {backend!r}")
        self.cuda_graphs = cuda_graphs
        self.compile_mode, self.image_compile_mode, self.backend = compile_mode, image_compile_mode, backend
        self._counter = _CountingBackend(backend, fail_on_recompile)

        def compiled(fn, mode):
            if mode is None:
                return fn
            return torch.compile(fn, backend=self._counter.for_mode(mode), fullgraph=True, dynamic=False)

        self._image = _Stage("encode_images", _bucket_list("image_buckets", image_buckets),
                             compiled(_encode_images_stage, image_compile_mode))
        self._pair = _Stage("ground", _bucket_list("pair_buckets", pair_buckets),
                            compiled(_ground_stage, compile_mode))
        self._captured = False
        self.capture_s: float | None = None

        cfg = detector.cfg
        s, d, g, ctx = cfg.image_size, cfg.d_model, cfg.feat_size, cfg.text.context_length
        b_max, p_max = self._image.buckets[-1], self._pair.buckets[-1]
        kw = dict(device=self.device, dtype=self.dtype)
        with torch.inference_mode():
            # input independent: the backbone's position buffers, as its forward returns them (model dtype)
            self._pos = [p.to(self.dtype) for p in detector.backbone.vision_backbone.positions()]
            levels = [tuple(p.shape[-2:]) for p in self._pos]  # (4G, 4G), (2G, 2G), (G, G)
            # static inputs, rows [:bucket] used by each bucket
            self._pixels = torch.zeros(b_max, 3, s, s, **kw)
            self._pair_fpn = [torch.zeros(p_max, d, h, w, **kw) for h, w in levels]
            self._pair_pos = [p.clone() for p in self._pos]
            self._pair_pos_src: list[torch.Tensor] = list(self._pos)  # what _pair_pos holds a copy of
            self._pair_geometry = torch.zeros(p_max, 1, d, **kw)
            self._pair_text = torch.zeros(p_max, ctx, d, **kw)
            self._pair_padding = torch.zeros(p_max, ctx, dtype=torch.bool, device=self.device)
        assert levels[-1] == (g, g), f"coarsest neck level {levels[-1]} != feature grid {g}"

    # ---- passthrough of what callers of a detector read

    @property
    def cfg(self):
        return self.detector.cfg

    @property
    def random_weights(self) -> bool:
        return self.detector.random_weights

    def parameters(self, recurse: bool = True):
        return self.detector.parameters(recurse)

    @property
    def image_buckets(self) -> tuple[int, ...]:
        return self._image.buckets

    @property
    def pair_buckets(self) -> tuple[int, ...]:
        return self._pair.buckets

    # ---- capture

    def capture(self) -> float:
        """Compile and (on CUDA) capture every bucket of both stages, largest first; returns seconds taken.

        Call once, after the weights are final and before any other thread issues CUDA work."""
        if self._captured:
            raise RuntimeError("GraphedDetector.capture() was already called")
        t0 = time.perf_counter()
        # dynamo caches one entry per shape on the stage function's code object; allow every bucket of this
        # instance on top of entries other instances left (steady-state lookups never consult this limit).
        limit = torch._dynamo.config.recompile_limit + len(self._image.buckets) + len(self._pair.buckets)
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit):
            if self.cuda_graphs:
                for stage in (self._image, self._pair):
                    stage.pool = torch.cuda.graph_pool_handle()
                    stage.capture_stream = torch.cuda.Stream(self.device)  # consecutive: two distinct streams
            for b in reversed(self._image.buckets):
                self._capture_bucket(self._image, b, lambda b=b: self._image_args(b))
            for p in reversed(self._pair.buckets):
                self._capture_bucket(self._pair, p, lambda p=p: self._pair_args(p))
        self._counter.sealed = True
        self._captured = True
        self.capture_s = time.perf_counter() - t0
        log.info("GraphedDetector: %s image buckets %s, pair buckets %s in %.1f s (%d graphs compiled)",
                 "captured" if self.cuda_graphs else "compiled", list(self._image.buckets),
                 list(self._pair.buckets), self.capture_s, self._counter.compiles)
        return self.capture_s

    def _capture_bucket(self, stage: _Stage, n: int, args: Callable[[], tuple]) -> None:
        t0 = time.perf_counter()
        if not self.cuda_graphs:
            stage.run(self.detector, *args())  # compile now, not in the first request
        else:
            side = stage.capture_stream
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_ITERS):
                    stage.run(self.detector, *args())
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=stage.pool, stream=side):
                stage.outputs[n] = stage.run(self.detector, *args())
            stage.graphs[n] = graph
            torch.cuda.synchronize(self.device)  # capture time only; not on the hot path
        stage.replays[n] = 0
        stage.capture_s[n] = time.perf_counter() - t0

    def _image_args(self, b: int) -> tuple:
        return (self._pixels[:b],)

    def _pair_args(self, p: int) -> tuple:
        return ([f[:p] for f in self._pair_fpn], self._pair_pos, self._pair_geometry[:p], self._pair_text[:p],
                self._pair_padding[:p])

    def _check_captured(self) -> None:
        if not self._captured:
            raise RuntimeError("GraphedDetector: call capture() before the first encode_images / ground")

    def _enter(self, stage: _Stage) -> None:
        """Called with the stage lock held: order this call after the previous one if it came from another stream."""
        if self.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        if stage.last_stream is not None and stage.last_stream != stream:
            stream.wait_stream(stage.last_stream)
        stage.last_stream = stream

    # ---- the three stages

    def encode_images(self, pixels: torch.Tensor) -> ImageFeatures:
        """pixels: [B, 3, S, S] in the model dtype on its device, B in `image_buckets`."""
        self._check_captured()
        stage = self._image
        if pixels.dim() != 4 or pixels.shape[1:] != self._pixels.shape[1:]:
            want = ", ".join(map(str, self._pixels.shape[1:]))
            raise ValueError(f"GraphedDetector.encode_images: pixels must be [B, {want}], got {list(pixels.shape)}")
        if pixels.dtype != self.dtype or pixels.device != self.device:
            raise ValueError(f"GraphedDetector.encode_images: pixels must be {self.dtype} on {self.device}, "
                             f"got {pixels.dtype} on {pixels.device}")
        b = pixels.shape[0]
        stage.check_bucket(b, "batch size")
        with torch.inference_mode(), stage.lock:
            self._enter(stage)
            self._pixels[:b].copy_(pixels)
            fpn, geometry = self._run(stage, b, self._image_args(b))
        return ImageFeatures(fpn, self._pos, geometry)

    def encode_prompts(self, token_ids: torch.Tensor) -> PromptFeatures:
        """Eager passthrough: prompt counts vary and features are cached per string by the engine."""
        with torch.inference_mode():
            return self.detector.encode_prompts(token_ids)

    def ground(
        self,
        images: ImageFeatures | Sequence[ImageFeatures],  # I distinct images: one [I, ...] or I of batch 1
        prompts: PromptFeatures,  # [U, L, d] distinct prompts of the batch
        image_index: torch.Tensor | Sequence[int],  # [P] row of `images` per pair (device or host)
        prompt_index: torch.Tensor | Sequence[int],  # [P] row of `prompts` per pair
    ) -> Grounding:
        """Same result as `Sam3Detector.ground` for P pairs, P in `pair_buckets` (bit-identical in eager numerics).

        `images` may also be a sequence of single-image ImageFeatures (the engine passes views into the image
        batches that computed them), which spares the caller a concatenation of ~56 MB of neck levels per image.
        With a host `image_index` the fpn levels are gathered by plain copies, one per run of pairs whose rows are
        adjacent in memory (the rows of one image batch in order: one copy per level for the whole batch); with a
        device index, by `index_select` (no host sync). Both only copy, so the graph's inputs are the same.
        """
        self._check_captured()
        stage = self._pair
        on_device = isinstance(image_index, torch.Tensor) and image_index.device == self.device
        host_index = None if on_device else [int(i) for i in torch.as_tensor(image_index).tolist()]
        per_image = None if isinstance(images, ImageFeatures) else list(images)
        if per_image is not None and host_index is None:
            raise ValueError(f"GraphedDetector.ground: images as a sequence of single-image features needs the "
                             f"image_index as a host list of ints, not a tensor on {self.device}")
        image_index, prompt_index = self._indices(image_index, prompt_index)
        p = image_index.shape[0]
        stage.check_bucket(p, "pair count")
        for one in per_image if per_image is not None else [images]:
            self._check_features(one, prompts)
        if per_image is not None:
            if not per_image:
                raise ValueError("GraphedDetector.ground: no images")
            dims = [(*(f.shape[0] for f in im.fpn), im.geometry.shape[0]) for im in per_image]
            if any(d != (1,) * len(d) for d in dims):
                raise ValueError("GraphedDetector.ground: a sequence of images must hold single-image features "
                                 f"(batch dims of fpn levels and geometry: {dims})")
        if host_index is not None:  # slices and run copies would not raise on a bad row the way index_select does
            count = len(per_image) if per_image is not None else images.fpn[0].shape[0]
            if max(host_index) >= count or min(host_index) < 0:
                raise ValueError(f"GraphedDetector.ground: image_index {host_index} out of range for {count} images")
        with torch.inference_mode(), stage.lock:
            self._enter(stage)
            if host_index is None:
                for src, dst in zip(images.fpn, self._pair_fpn):
                    torch.index_select(src, 0, image_index, out=dst[:p])
            else:
                for level, dst in enumerate(self._pair_fpn):
                    if per_image is not None:
                        rows = [per_image[i].fpn[level] for i in host_index]
                    else:
                        rows = [images.fpn[level][i:i + 1] for i in host_index]
                    copy_rows(dst, rows)
            if per_image is not None:  # [1, 1, d] each: adjacent ones in one copy too
                copy_rows(self._pair_geometry, [per_image[i].geometry for i in host_index])
            else:
                torch.index_select(images.geometry, 0, image_index, out=self._pair_geometry[:p])
            torch.index_select(prompts.features, 0, prompt_index, out=self._pair_text[:p])
            torch.index_select(prompts.padding, 0, prompt_index, out=self._pair_padding[:p])
            pos = (per_image[0] if per_image is not None else images).pos
            if any(a is not b for a, b in zip(pos, self._pair_pos_src)):
                for src, dst in zip(pos, self._pair_pos):
                    dst.copy_(src)
                self._pair_pos_src = list(pos)
            out = self._run(stage, p, self._pair_args(p))
        return Grounding(*out)

    def _run(self, stage: _Stage, n: int, args: tuple) -> Any:
        """Replay bucket n's graph and clone its outputs, or (no graphs) call the compiled function."""
        stage.replays[n] += 1
        if not self.cuda_graphs:
            return stage.run(self.detector, *args)
        stage.graphs[n].replay()
        return torch.utils._pytree.tree_map(torch.Tensor.clone, stage.outputs[n])

    def _indices(self, image_index, prompt_index) -> tuple[torch.Tensor, torch.Tensor]:
        """Both index vectors as long tensors on the device; host lists take one pinned, non-blocking copy."""
        shapes = [tuple(torch.as_tensor(i).shape) if not isinstance(i, torch.Tensor) else tuple(i.shape)
                  for i in (image_index, prompt_index)]
        if len(shapes[0]) != 1 or shapes[0] != shapes[1]:
            raise ValueError(f"GraphedDetector.ground: image_index {list(shapes[0])} and prompt_index "
                             f"{list(shapes[1])} must be two [P] vectors of the same length")
        on_device = [isinstance(i, torch.Tensor) and i.device == self.device for i in (image_index, prompt_index)]
        if all(on_device):
            image_index, prompt_index = image_index.long(), prompt_index.long()
        else:
            both = torch.stack([torch.as_tensor(image_index, dtype=torch.long, device="cpu"),
                                torch.as_tensor(prompt_index, dtype=torch.long, device="cpu")])  # [2, P]
            if self.device.type == "cuda":
                both = both.pin_memory().to(self.device, non_blocking=True)
            image_index, prompt_index = both.to(self.device)
        return image_index, prompt_index

    def _check_features(self, images: ImageFeatures, prompts: PromptFeatures) -> None:
        want = [("fpn", list(images.fpn), self._pair_fpn), ("pos", list(images.pos), self._pair_pos),
                ("geometry", [images.geometry], [self._pair_geometry]),
                ("prompt features", [prompts.features], [self._pair_text]),
                ("prompt padding", [prompts.padding], [self._pair_padding])]
        for name, got, static in want:
            if len(got) != len(static):
                raise ValueError(f"GraphedDetector.ground: {name} has {len(got)} levels, expected {len(static)}")
            for t, s in zip(got, static):
                if t.shape[1:] != s.shape[1:] or t.dtype != s.dtype or t.device != s.device:
                    raise ValueError(f"GraphedDetector.ground: {name} is {list(t.shape)} {t.dtype} on {t.device}, "
                                     f"expected [*, {', '.join(map(str, s.shape[1:]))}] {s.dtype} on {s.device}")

    # ---- reporting

    def stats(self) -> dict[str, Any]:
        def one(stage: _Stage) -> dict[str, Any]:
            return {"buckets": list(stage.buckets),
                    "captured": sorted(stage.graphs) if self.cuda_graphs else [],
                    "replays": dict(stage.replays),
                    "capture_s": {k: round(v, 3) for k, v in stage.capture_s.items()}}

        return {
            "cuda_graphs": self.cuda_graphs,
            "compile_mode": self.compile_mode,
            "image_compile_mode": self.image_compile_mode,
            "backend": self.backend if self.compile_mode is not None else None,
            "captured": self._captured,
            "capture_s": None if self.capture_s is None else round(self.capture_s, 3),
            "compiles": self._counter.compiles,
            "recompiles": self._counter.recompiles,
            "encode_images": one(self._image),
            "ground": one(self._pair),
        }
