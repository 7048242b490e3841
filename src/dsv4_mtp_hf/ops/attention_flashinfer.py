"""Sliding-window sink attention on FlashInfer's MLA kernels (design §2, §8).

The MTP layer's attention is MQA with one 512-dim KV head used as both key and value:
FlashInfer's ``BatchMLAPagedAttentionWrapper`` computes exactly that with the whole head as
the compressed KV (``head_dim_ckv=512``) and no separate RoPE part (``head_dim_kpe=0``,
runs on the fa3 and fa2 kernels).  What the kernels lack, we add around them:

* **Window.**  The MTP cache hands the attention its keys as ``kv [B, L, d]``: held keys in
  position order, then the ``S`` new rows (design §2; :meth:`PagedMtpKVCache.update`).  With
  ``page_size=1`` each query row becomes its own request whose page list is the slots of
  its window -- ``min(window, position + 1)`` keys ending at its own -- so the mask is in
  the metadata and the kernel attends to nothing else.  Keys carry their RoPE, so the order
  inside a window is irrelevant.
* **Sinks.**  The kernel returns the base-2 log-sum-exp; a sink logit ``s_h`` in the
  denominator scales head h's output by ``sigmoid(lse * ln 2 - s_h)``.

The page lists depend only on each query's position (through ``min(window, p + 1)``) and
the shape of ``kv``, never on the values: ``plan()`` builds them on the host, FlashInfer
style, and ``run()`` only launches.  For CUDA graphs, :class:`FlashInferWindowPlans` keeps
one wrapper per captured step over fixed metadata buffers (``use_cuda_graph=True``): the
host re-plans them between replays (FlashInfer's fa2/fa3 plans may be redone in place), so
a replay sees each step's own key counts.  Once every sequence is a window long the plans
stop changing.  The launch goes through the ``dsv4_mtp::flashinfer_window_attention``
custom op, opaque to ``torch.compile`` (Dynamo and Inductor trace around it on CPU; not yet
compiled on the GPU: the plan handle is a constant to Dynamo, so each drafter would compile
its own step, and compiled drafters keep the reference attention -- see ``GraphedDrafter``).
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch

LIB = "dsv4_mtp"
LN2 = math.log(2.0)
FLOAT_WORKSPACE_BYTES = 64 << 20  # split-KV partial outputs: ~17 MB at 64-128 heads x 512 on 132 SMs
MAX_ROWS = 4096  # query rows per call (one request each); FlashInfer's FA planner caps work items at 16384
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
INSTALL_HINT = "install FlashInfer (`pip install flashinfer-python`)"

_import_error: str | None = None  # "" once FlashInfer imported fine
_float_workspaces: dict[torch.device, torch.Tensor] = {}
_plans: weakref.WeakValueDictionary[int, FlashInferWindowPlans] = weakref.WeakValueDictionary()
_handles = itertools.count()


def flashinfer_import_error() -> str | None:
    """None when ``flashinfer.mla`` imports, else why not (imported once, then remembered)."""
    global _import_error
    if _import_error is None:
        try:
            import flashinfer.mla  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any import failure means "not available"
            _import_error = f"{type(err).__name__}: {err}"
        else:
            _import_error = ""
    return _import_error or None


def _supported(dtype: torch.dtype, device: torch.device, head_dim: int, rows: int, paged_cache: bool,
               needs_grad: bool) -> bool:
    # Plain comparisons only: torch.compile traces this inside the draft step.
    return (paged_cache and device.type == "cuda" and dtype in SUPPORTED_DTYPES and head_dim % 128 == 0
            and rows <= MAX_ROWS and not needs_grad)


def _unsupported_reasons(dtype: torch.dtype, device: torch.device, head_dim: int, rows: int,
                         paged_cache: bool, needs_grad: bool) -> list[str]:
    """Why FlashInfer cannot run this call, each reason with its fix (empty: it can)."""
    reasons = []
    if flashinfer_import_error() is not None:
        reasons.append(f"FlashInfer is not importable ({flashinfer_import_error()}): {INSTALL_HINT}")
    if not paged_cache:
        reasons.append("it needs the paged MTP cache: pass `past_key_values=mtp.new_cache(paged=True, batch_size=B)`")
    if device.type != "cuda":
        reasons.append(f"the inputs are on {device}; FlashInfer runs on CUDA devices only")
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"its MLA kernels take bfloat16/float16, the attention runs in {dtype}: load the MTP with "
                       "`torch_dtype=torch.bfloat16`")
    if head_dim % 128:
        reasons.append(f"head_dim={head_dim} is not a multiple of 128 (fa2/fa3 MLA tiles)")
    if rows > MAX_ROWS:
        reasons.append(f"{rows} query rows exceed {MAX_ROWS} per call: run the forward in blocks of at most "
                       f"{MAX_ROWS} rows")
    if needs_grad:
        reasons.append("the kernels have no backward: draft under `torch.no_grad()`, train with 'reference'")
    return reasons


def select_attention_backend(requested: str, dtype: torch.dtype, device: torch.device, head_dim: int, rows: int,
                             paged_cache: bool, needs_grad: bool = False) -> str:
    """``"flashinfer"`` or ``"reference"`` for one attention call of ``rows`` query rows.

    ``"auto"`` takes FlashInfer when it can run the call and the reference otherwise;
    ``"flashinfer"`` raises, naming each problem and its fix, instead of falling back.
    The import is tried only once the cheap checks pass, so CPU calls never import FlashInfer."""
    if requested == "reference":
        return "reference"
    if requested not in ("auto", "flashinfer"):
        raise ValueError(f"attention_backend must be 'auto', 'reference' or 'flashinfer', got {requested!r}.")
    ok = _supported(dtype, device, head_dim, rows, paged_cache, needs_grad) and flashinfer_import_error() is None
    if ok or requested == "auto":
        return "flashinfer" if ok else "reference"
    raise RuntimeError(
        "attention_backend='flashinfer' cannot run this attention call: "
        + "; ".join(_unsupported_reasons(dtype, device, head_dim, rows, paged_cache, needs_grad))
        + ". Or set `config.attention_backend` to 'auto' (FlashInfer where it runs) or 'reference'."
    )


def window_metadata(first_positions: list[int], num_keys: int, num_queries: int, window: int):
    """Host CSR metadata of a window attention with ``page_size=1``.

    Sequence b has ``num_keys`` key columns in ``kv`` (flattened to ``[B * num_keys]``
    slots), the last ``num_queries`` of them being its queries' own keys at positions
    ``first_positions[b] + i``; the columns before are the consecutive earlier positions
    (negative ones are padding).  Query row ``(b, i)`` sees ``min(window, p + 1, column + 1)``
    keys ending at its own column.  Returns int32 ``(qo_indptr, kv_indptr, kv_indices,
    kv_lens)`` for ``R = B * num_queries`` requests of one query row each."""
    b, s = len(first_positions), num_queries
    i = torch.arange(s)
    p0 = torch.tensor(first_positions, dtype=torch.long).unsqueeze(1)
    own = (torch.arange(b).unsqueeze(1) * num_keys + (num_keys - s) + i).flatten()  # [R] own key slot
    lens = torch.minimum(torch.minimum(p0 + i + 1, (num_keys - s) + i + 1), torch.tensor(window)).flatten()
    j = torch.arange(window)
    kv_indices = (own.unsqueeze(1) - j)[j < lens.unsqueeze(1)]  # newest first, packed per request
    kv_indptr = torch.zeros(b * s + 1, dtype=torch.long)
    kv_indptr[1:] = lens.cumsum(0)
    qo_indptr = torch.arange(b * s + 1)
    return qo_indptr.int(), kv_indptr.int(), kv_indices.int(), lens.int()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _float_workspace(device: torch.device) -> torch.Tensor:
    # One per device, shared by every wrapper: calls on one stream never overlap.
    if device not in _float_workspaces:
        _float_workspaces[device] = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _float_workspaces[device]


def default_kernel_backend(device: torch.device) -> str:
    """fa3 on Hopper (sm_90a), fa2 elsewhere: the two whose graph plans can be redone in place."""
    from flashinfer.utils import is_sm90a_supported

    return "fa3" if is_sm90a_supported(device) else "fa2"


class _Slot:
    """One ``BatchMLAPagedAttentionWrapper`` and the key of its current plan."""

    def __init__(self, device: torch.device, kernel_backend: str, rows: int | None, window: int):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.rows, self.key = rows, None
        buffers = {}
        if rows is not None:  # graph-safe: plan() copies into these fixed buffers, run() reads them
            i32 = dict(dtype=torch.int32, device=device)
            buffers = dict(qo_indptr=torch.zeros(rows + 1, **i32), kv_indptr=torch.zeros(rows + 1, **i32),
                           kv_indices=torch.zeros(rows * window, **i32), kv_len_arr=torch.zeros(rows, **i32))
        self.wrapper = BatchMLAPagedAttentionWrapper(
            _float_workspace(device), use_cuda_graph=rows is not None, backend=kernel_backend, **buffers
        )


class FlashInferWindowPlans:
    """Planned FlashInfer window attention for one MTP attention layer.

    ``steps`` graph-safe wrappers of ``rows`` query rows (one per captured draft step, used in
    order after :meth:`rewind`) plus one wrapper for every other call, re-planned whenever
    the positions change.  Outside graph capture every call checks its plan against the
    actual positions (one host read), so eager calls are always exact; a captured step must
    have been planned for the replay's positions with :meth:`plan_decode_steps`."""

    def __init__(self, num_heads: int, head_dim: int, window: int, scale: float, dtype: torch.dtype,
                 device: torch.device | str, steps: int = 0, rows: int | None = None,
                 kernel_backend: str | None = None):
        if steps and rows is None:
            raise ValueError("graph-safe plans (steps > 0) need the number of query rows `rows`.")
        error = flashinfer_import_error()
        if error is not None:
            raise RuntimeError(f"FlashInfer attention plans need FlashInfer ({error}): {INSTALL_HINT}.")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_heads, self.head_dim, self.window, self.scale, self.dtype = num_heads, head_dim, window, scale, dtype
        self.kernel_backend = kernel_backend or default_kernel_backend(device)
        self.steps = [_Slot(device, self.kernel_backend, rows, window) for _ in range(steps)]
        self.dynamic = _Slot(device, self.kernel_backend, None, window)
        self.cursor = len(self.steps)  # no step slot until rewind()
        self.handle = next(_handles)
        _plans[self.handle] = self

    def rewind(self) -> None:
        """The next ``len(steps)`` calls use the step wrappers, in order (one draft run)."""
        self.cursor = 0

    def _plan(self, slot: _Slot, first_positions: list[int], num_keys: int, num_queries: int) -> None:
        from flashinfer.mla import MLAPlanMetadata

        # Once every sequence is past its first window the key counts stop depending on the positions.
        saturated = all(p >= self.window - 1 for p in first_positions)
        key = (len(first_positions) if saturated else tuple(first_positions), num_keys, num_queries)
        if slot.key == key:
            return
        qo_indptr, kv_indptr, kv_indices, kv_lens = window_metadata(first_positions, num_keys, num_queries, self.window)
        slot.wrapper.plan(
            metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_lens),
            num_heads=self.num_heads, head_dim_ckv=self.head_dim, head_dim_kpe=0, page_size=1, causal=False,
            sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype, lse_mode="base2",
        )
        slot.key = key

    def plan_decode_steps(self, seq_lengths: list[int]) -> None:
        """Host-side, outside capture: plan step k for one new row per sequence at position
        ``seq_lengths[b] + k`` over the paged cache's ``window`` key columns."""
        for k, slot in enumerate(self.steps):
            self._plan(slot, [n + k for n in seq_lengths], self.window, 1)

    def run(self, q: torch.Tensor, kv: torch.Tensor, first_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, S, H, d]``, kv ``[B, L, d]``, first_positions ``[B]`` -> (o ``[B, S, H, d]``
        without sinks, base-2 LSE ``[B, S, H]`` fp32)."""
        b, s, h, d = q.shape
        num_keys = kv.shape[1]
        slot = self.dynamic
        if self.cursor < len(self.steps) and b * s == self.steps[self.cursor].rows:
            slot = self.steps[self.cursor]
            self.cursor += 1
        if _capturing():
            if slot is self.dynamic or slot.key is None or slot.key[1:] != (num_keys, s):
                raise RuntimeError(
                    "FlashInfer attention is planned on the host, outside CUDA-graph capture: capture MTP draft steps "
                    "through `GraphedDrafter` (it plans each step before capturing and before every replay), or use "
                    "`config.attention_backend='reference'` for other graphs."
                )
        else:
            self._plan(slot, first_positions.tolist(), num_keys, s)
        # Contiguous in and out, whatever strides a compiled graph hands over: the fake below promises these.
        out = torch.empty(b * s, h, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(b * s, h, dtype=torch.float32, device=q.device)
        slot.wrapper.run(query=q.reshape(b * s, h, d).contiguous(), kv_cache=kv.reshape(b * num_keys, 1, d).contiguous(),
                         out=out, lse=lse, return_lse=True)
        return out.view(b, s, h, d), lse.view(b, s, h)


@torch.library.custom_op(f"{LIB}::flashinfer_window_attention", mutates_args=())
def flashinfer_window_attention_op(q: torch.Tensor, kv: torch.Tensor, first_positions: torch.Tensor,
                                   handle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The planned FlashInfer launch of :class:`FlashInferWindowPlans` ``handle`` (opaque to
    ``torch.compile``; planning reads positions on the host, which a traced graph cannot)."""
    if not q.is_cuda:  # the CPU stand-in of the tests
        return _plans[handle].run(q, kv, first_positions)
    with torch.cuda.device(q.device):  # launch on the tensors' GPU (an MTP beside a split target's head)
        return _plans[handle].run(q, kv, first_positions)


@flashinfer_window_attention_op.register_fake
def _(q, kv, first_positions, handle):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def sliding_window_attention_flashinfer(
    q: torch.Tensor,
    kv: torch.Tensor,
    first_positions: torch.Tensor,
    sinks: torch.Tensor,
    plans: FlashInferWindowPlans,
) -> torch.Tensor:
    """:func:`~dsv4_mtp_hf.ops.attention.sliding_window_attention_reference` on FlashInfer.

    q ``[B, S, H, d]``; kv ``[B, L, d]`` whose last S columns are the queries' own keys and
    whose earlier columns hold the consecutive positions before them; ``first_positions
    [B]`` the position of each sequence's first query; sinks ``[H]`` -> ``[B, S, H, d]`` in
    q's dtype.  Window, scale and dtype come from ``plans``."""
    out, lse = flashinfer_window_attention_op(q, kv.to(q.dtype), first_positions, plans.handle)
    keep = torch.sigmoid(lse * LN2 - sinks.float())  # the sink's share of the denominator, removed
    return (out.float() * keep.unsqueeze(-1)).to(q.dtype)
