"""STAND-IN for ``sgl_kernel`` (SGLang's compiled kernels), launch tier only.

Reason: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few CPU kernels from ``sgl_kernel`` unconditionally, but the
CPU build of sgl-kernel needs AVX-512/AMX and a source build (``-march=native``), and the registry's ``sgl-kernel`` /
``sglang-kernel`` wheels are CUDA-only: nothing real can load on this machine. Each function below does in plain
torch what the kernel's docstring-level contract says (toy batches only, so loops are fine). Any other name resolves
to a callable that raises ``NotImplementedError`` naming it, so a gap shows up as a clear error, never a silent result.

``torch.ops.sgl_kernel.*`` stays empty unless ``LAUNCH_CPU_ATTN_OPS=1``: SGLang's AMX checks
(``hasattr(torch.ops.sgl_kernel, ...)``) then stay False and every layer takes ``forward_native``; with the variable,
the two attention ops ``IntelAMXAttnBackend`` calls are attached (speculative decoding needs that backend, see
``launch_cpu_gaps``). The kernels' argument lists follow the sgl-kernel each release was built against: from 0.5.20 the
KV buffers are followed by their two float scales, before that they are not (the ops take either, see ``_kv_scales``).
Not SGLang code and not the plugin: the plugin under test never touches these ops.
"""

from __future__ import annotations

import ctypes
import os

import torch


def _spans(req_pool_indices, start_offset, end_offset):
    pos = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        yield int(req_pool_indices[i]), s, e, pos
        pos += e - s


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    for row, s, e, pos in _spans(req_pool_indices, start_offset, end_offset):
        req_to_token[row, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    for row, s, e, pos in _spans(req_pool_indices, start_offset, end_offset):
        out_cache_loc[pos : pos + e - s] = req_to_token[row, s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                                          num_steps):  # fmt: skip
    n = topk * num_steps
    for i in range(req_pool_indices.numel()):
        s = int(seq_lens[i])
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[int(req_pool_indices[i]), s : s + n].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    # Raw buffers (one pointer and row stride in bytes per KV buffer): row tgt <- row src, read all before writing.
    src, tgt = [int(x) for x in src_loc.tolist()], [int(x) for x in tgt_loc.tolist()]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    flat = accept_tokens.reshape(-1)
    for i in range(accept_lens.numel()):
        bonus_tokens[i] = flat[accept_stride * i + int(accept_lens[i]) - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def _parent_position(selected, parents, parent_tb_idx, n):
    """Position (1-based, 0 = the root) of a draft token's parent in the tree, or None when not in it."""
    if parent_tb_idx == 0:
        return 0
    token = parents[parent_tb_idx]
    return next((p + 1 for p in range(n - 1) if selected[p] == token), None)


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                    topk, depth, draft_token_num, tree_mask_mode):  # fmt: skip
    """The draft tree of each request: retrieve links (first child / next sibling), positions, and the attention mask
    (mode 0: full mask over prefix + tree; mode 1: tree-only rows). Other modes are refused."""
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"sgl_kernel STAND-IN: tree_mask_mode {mode}")
    bs, n = verified_seq_len.shape[0], draft_token_num
    seq = [int(x) for x in verified_seq_len.tolist()]
    parents_all = parent_list.reshape(bs, -1) if parent_list.dim() > 1 else parent_list.reshape(1, -1).expand(bs, -1)
    selected_all = selected_index.reshape(bs, -1)
    mask, pos = tree_mask.view(-1), positions.view(-1)
    ri, nxt, sib = retrieve_index.view(-1), retrieve_next_token.view(-1), retrieve_next_sibling.view(-1)
    prefix_total = 0
    for b in range(bs):
        selected, parents = selected_all[b].tolist(), parents_all[b].tolist()
        off, seq_len = b * n, seq[b]
        pos[off] = seq_len
        ri[off] = off
        for i in range(n - 1, 0, -1):  # last to first, so siblings chain in order
            ri[off + i] = off + i
            p = _parent_position(selected, parents, selected[i - 1] // topk, n)
            if p is not None:
                first = int(nxt[off + p])
                nxt[off + p] = i
                if first != -1:
                    sib[off + i] = first
        for x in range(n):
            full_row = n * n * b + prefix_total * n + (seq_len + n) * x + seq_len + 1
            start = full_row if mode == 0 else n * n * b + n * x + 1
            mask[start - 1] = True
            mask[start : start + n - 1] = False
            depth_x, cur = 0, x - 1
            while x > 0 and depth_x < depth:
                depth_x += 1
                mask[start + cur] = True
                p = _parent_position(selected, parents, selected[cur] // topk, n)
                if not p:
                    break
                cur = p - 1
            pos[off + x] = seq_len + depth_x
        prefix_total += seq_len


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):  # fmt: skip
    """Greedy acceptance: walk the tree from the root, at each depth take the child equal to the target's token."""
    bs, n = candidates.shape[0], candidates.shape[1]
    pred, target = predicts.view(-1), target_predict.reshape(-1)
    ri, nxt, sib, cand = (t.reshape(-1) for t in (retrive_index, retrive_next_token, retrive_next_sibling, candidates))
    for b in range(bs):
        last = int(ri[b * n])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, accept_index.shape[1]):
            cur = int(nxt[b * n + cur])
            want = int(target[last])
            while cur != -1 and int(cand[b * n + cur]) != want:
                cur = int(sib[b * n + cur])
            if cur == -1:
                break
            pred[last] = want
            accepted += 1
            last = int(ri[b * n + cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        pred[last] = target[last]


def _attend(q, k, v, scale, mask=None):
    """q [n,H,D], k/v [m,KH,D] -> [n,H,Dv]; grouped-query attention by repeating KV heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _refuse_extras(logit_cap, is_cross, sliding_window, sinks, tree_mask=None):
    if logit_cap or is_cross or sliding_window > 0 or sinks is not None or tree_mask is not None:
        raise NotImplementedError("sgl_kernel STAND-IN attention: logit cap/cross/sliding window/sinks/tree mask")


def _kv_scales(args: tuple, at: int) -> tuple:
    """``args`` with the KV scales at ``at``: sgl-kernel before SGLang 0.5.20 has none (a tensor already sits there,
    the next argument of that schema), and an unscaled cache reads as scale 1.0."""
    return (*args[:at], 1.0, 1.0, *args[at:]) if isinstance(args[at], torch.Tensor) else args


def decode_attention_cpu(*args, **kwargs):
    return _decode_attention(*_kv_scales(args, 3), **kwargs)


def extend_attention_cpu(*args, **kwargs):
    return _extend_attention(*_kv_scales(args, 6), **kwargs)


def _decode_attention(query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc, attn_logits,
                         req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap=0.0, is_cross=False,
                         sliding_window=0, encoder_lens=None, sinks=None):  # fmt: skip
    _refuse_extras(logit_cap, is_cross, sliding_window, sinks)
    if key is not None:  # the kernel stores this step's KV itself
        k_cache[loc] = key.to(k_cache.dtype)
        v_cache[loc] = value.to(v_cache.dtype)
    # DP padding can leave extra query rows: zero, as the kernel leaves them. 0.5.18's draft decode passes the forward
    # batch's padded seq_lens with the draft metadata's unpadded req_pool_indices (its forward_decode overrides the
    # draft seq_lens): the rows past those indices are padding too.
    n = min(seq_lens.shape[0], query.shape[0], req_pool_indices.shape[0])
    output[n:] = 0
    for i in range(n):
        toks = req_to_token[int(req_pool_indices[i]), : int(seq_lens[i])].long()
        output[i : i + 1] = _attend(query[i : i + 1], k_cache[toks] * k_scale, v_cache[toks] * v_scale, sm_scale)


def _extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token,
                         req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale,
                         logit_cap=0.0, is_cross=False, sliding_window=0, encoder_lens=None, sinks=None,
                         tree_mask=None, is_causal=True):  # fmt: skip
    _refuse_extras(logit_cap, is_cross, sliding_window, sinks, tree_mask)
    # 0.5.18 passes the forward batch's DP-padded seq_lens with the unpadded extend metadata (see decode): rows past
    # that metadata are padding, their output rows zero.
    n = min(seq_lens.shape[0], extend_seq_lens.shape[0], req_pool_indices.shape[0])
    if n < seq_lens.shape[0]:
        written = int(extend_start_loc[n - 1]) + int(extend_seq_lens[n - 1]) if n else 0
        o_extend[written:] = 0
    for i in range(n):
        total, ext, start = int(seq_lens[i]), int(extend_seq_lens[i]), int(extend_start_loc[i])
        prefix = total - ext
        toks = req_to_token[int(req_pool_indices[i]), :total].long()
        k, v = k_buffer[toks] * k_scale, v_buffer[toks] * v_scale
        if k_extend is not None:
            k = torch.cat((k[:prefix], k_extend[start : start + ext].to(k.dtype)))
            v = torch.cat((v[:prefix], v_extend[start : start + ext].to(v.dtype)))
        mask = torch.arange(total)[None, :] <= (prefix + torch.arange(ext))[:, None] if is_causal else None
        o_extend[start : start + ext] = _attend(q_extend[start : start + ext], k, v, sm_scale, mask)


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    if topk != 1:
        raise NotImplementedError("sgl_kernel STAND-IN: build_draft_decode_metadata_cpu with topk > 1")
    return req_to_token[req_pool_indices.long()].clone()  # topk 1: candidate i reads request i's row


if os.environ.get("LAUNCH_CPU_ATTN_OPS"):
    torch.ops.sgl_kernel.decode_attention_cpu = decode_attention_cpu
    torch.ops.sgl_kernel.extend_attention_cpu = extend_attention_cpu


class _Missing:
    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel STAND-IN: {self.__name__} is not implemented")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)


__version__ = "0.0.0+cpu-stand-in"
