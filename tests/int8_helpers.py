"""acco's int8 estimate round written out plainly (`reference_int8`) and the engine run that
records what it sends (`train_counting`): shared by tests/test_estimate_int8.py and the two-level
rounds' tests/test_nodes.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from engine_helpers import Reference, loss_fn, make_model, stream
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from acco.engine import build_engine
from acco.engine import quantize as qz
from acco.engine.comm import RoundKind

# the engine tests' block: several per shard, the last one short (the toy models have ~500 parameters)
BLOCK = 64


# ---- the engine against the plain reference --------------------------------------------------


def engine_order(model) -> torch.Tensor:
    """Index, in parameters_to_vector's order, of each element of the engine's flat vector
    (FlatParams: the matrices first, then the vectors)."""
    spans, start = [], 0
    for p in model.parameters():
        spans.append((p.dim() >= 2, torch.arange(start, start + p.numel())))
        start += p.numel()
    return torch.cat([idx for big, idx in spans if big] + [idx for big, idx in spans if not big])


def local_orders(model, S: int) -> list[torch.Tensor]:
    """Sharded inside the node (acco/engine/node_shards.py): for each local index s, the index in
    parameters_to_vector's order of each element of its local vector (-1: padding): the matrices
    first, then the vectors, each parameter's rows [s c, s c + c) with c = ceil(rows / S)."""
    spans, start = [], 0
    for p in model.parameters():
        spans.append((p, torch.arange(start, start + p.numel()).view(p.shape)))
        start += p.numel()
    spans = [x for x in spans if x[0].dim() >= 2] + [x for x in spans if x[0].dim() < 2]
    orders = []
    for s in range(S):
        parts = []
        for p, idx in spans:
            c = -(-p.shape[0] // S)
            rows = idx[s * c : (s + 1) * c].reshape(-1)
            parts += [rows, torch.full((c * p[0].numel() - rows.numel(),), -1)]
        orders.append(torch.cat(parts))
    return orders


def reference_int8(kind, cfg, world, updates, block, bounds=None, estimates=None, dtype=torch.float32,
                   workers_per_node=1, sharded=False):
    """acco with the estimate round quantized as the engine does it, written out: the estimate's
    gradient is each worker's own sum, quantized shard by shard (blocks per shard) and summed in
    fp32; theta~ = theta_t + dequantized (theta~_exact - theta_t); the update round commits
    Opt(theta_t, exact mean of g~_t + g_t). ``bounds``: a list that receives, per estimate round,
    the largest error / bound ratio of the gradient and of the gathered estimate; ``estimates``:
    a list that receives (theta~ as gathered, theta~ before the all-gather's quantization, each
    element's quantum). ``workers_per_node`` S > 1 (the two-level rounds, fp32): what is quantized is
    each node's exact sum of its S workers' gradients, shard by shard; ``sharded`` (sharding inside
    the node): the shards are those of each local index's local vector (`local_orders`), R each.

    ``dtype`` bf16 (mixed precision) rounds where the engine does: gradients at bf16(theta), each
    worker's added up micro-batch by micro-batch in bf16 (grad_accum_dtype bf16; the update's payload
    goes on from the estimate's), the update round's sum in bf16 in the ring's order, and theta~ =
    bf16(bf16(theta_t) + dequantized (theta~_exact - bf16(theta_t))): the delta against the parameters
    every worker holds, not the fp32 master. The master, the trial step and the error stay fp32."""
    lowp = dtype != torch.float32
    counts = [cfg.n_grad_accumulation] * world
    ref = Reference(kind, cfg, world, counts)
    order = engine_order(ref.model)
    numel = order.numel()
    shard = -(-numel // world)

    def shards(v):  # [W, S] in the engine's order, zero-padded, in v's dtype
        out = torch.zeros(world * shard, dtype=v.dtype)
        out[:numel] = v[order]
        return out.view(world, shard)

    def back(u):
        v = torch.empty(numel, dtype=u.dtype)
        v[order] = u.reshape(-1)[:numel]
        return v

    if sharded:  # rows (s, r): shard r of local index s's local vector, padded to R shards
        orders, R = local_orders(ref.model, workers_per_node), world // workers_per_node
        shard = -(-orders[0].numel() // R)

        def shards(v):  # noqa: F811
            rows = []
            for idx in orders:
                u, held = torch.zeros(R * shard, dtype=v.dtype), idx >= 0
                u[: idx.numel()][held] = v[idx[held]]
                rows.append(u.view(R, shard))
            return torch.cat(rows)

        def back(u):  # noqa: F811
            v = torch.empty(numel, dtype=u.dtype)
            for s, idx in enumerate(orders):
                held = idx >= 0
                v[idx[held]] = u[s * R : (s + 1) * R].reshape(-1)[: idx.numel()][held]
            return v

    def per_worker_grads(theta, running=None):
        """Each worker's sum of its next micro-batches' gradients at theta (bf16: added one by one to
        its ``running`` sum, in bf16)."""
        chunk = ref.next_chunk()
        if not lowp:
            sums, start = [], 0
            for n in counts:
                sums.append(ref.grad_sum(theta, chunk[start : start + n])[0])
                start += n
            return sums
        probe = copy.deepcopy(ref.model).to(dtype)
        params = list(probe.parameters())
        vector_to_parameters(theta.to(dtype), params)
        sums, start = [], 0
        for w, n in enumerate(counts):
            total = None if running is None else running[w]
            for x, y in chunk[start : start + n]:
                probe.zero_grad()
                loss_fn(probe, (x.to(dtype), y.to(dtype))).backward()
                g = parameters_to_vector([p.grad for p in params])
                total = g if total is None else total + g
            sums.append(total)
            start += n
        return sums

    def ring_sum(payloads):
        """The update round's reduce-scatter in the payloads' dtype: chunk c is summed along the ring
        from worker c + 1 to worker c (collectives.reduce_scatter)."""
        out = torch.empty(world, shard, dtype=payloads[0].dtype)
        rows = [shards(p) for p in payloads]
        for c in range(world):
            acc = rows[(c + 1) % world][c]
            for j in range(2, world + 1):
                acc = acc + rows[(c + j) % world][c]
            out[c] = acc
        return back(out)

    def reduce_scatter(grads):
        S = workers_per_node
        grads = [sum(grads[i : i + S]) for i in range(0, world, S)]  # the inner level: exact
        total, bound = torch.zeros(world, shard), torch.zeros(world, shard)
        for g in grads:  # rank order, fp32
            for r, row in enumerate(shards(g)):
                q, s = qz.fake_quantize(row, block)
                total[r] += q
                bound[r] += qz.error_bound(s, shard, block)
        exact = shards(sum(g.float() for g in grads))
        if bounds is not None:
            bounds.append(("grad", float(((total - exact).abs() / bound.clamp_min(1e-30)).max())))
        return back(total)

    def gather_delta(estimate, theta):
        # the base: the parameters every worker holds during the round, theta_t in the model's dtype
        out, base, quantum = torch.empty(world, shard), shards(theta.to(dtype)), torch.empty(world, shard)
        for r, row in enumerate(shards(estimate) - base):  # fp32
            q, s = qz.fake_quantize(row, block)
            out[r] = (base[r] + q).to(dtype)  # (held in fp32: bf16 values are exact there)
            quantum[r] = s.repeat_interleave(block)[:shard]
            if bounds is not None:  # bf16: and theta~'s own rounding, at most 2^-8 |theta~|
                bound = qz.error_bound(s, shard, block) + (2.0**-8 * out[r].abs() if lowp else 0) + 1e-7
                ratio = (out[r] - shards(estimate)[r]).abs() / bound
                bounds.append(("estimate", float(ratio.max())))
        return back(out), back(quantum)

    lean = cfg.acco_estimate == "lean"
    theta = ref.theta()
    g_est = per_worker_grads(theta)  # warm start: g~_0 at theta_0
    n_est = sum(counts)
    error = torch.zeros_like(theta)
    for _ in range(updates):
        exact = ref.trial(theta, reduce_scatter(g_est), n_est, update_batch=n_est + sum(counts))
        if lean:
            exact = exact + 0.5 * error
        theta_est, quantum = gather_delta(exact, theta)
        if estimates is not None:
            estimates.append((theta_est, exact, quantum))
        if lowp:  # g_t at theta_t, on top of g~_t in each worker's bf16 payload; summed in bf16
            total = ring_sum(per_worker_grads(theta, running=g_est)).float()
        else:
            g, _ = ref.grad_sum(theta, ref.next_chunk())  # g_t at theta_t, exact
            total = sum(g_est) + g
        theta = ref.commit(theta, total, n_est + sum(counts))
        error = exact - theta
        g_est = per_worker_grads(theta_est)
    return theta


def train_counting(rank, world, kind, cfgs, block):
    """Every rank: train with each config; final parameters, records, the bytes this rank sent per
    round, by kind (the all-to-all and the ring's sends; the statistics' small all-gather apart),
    each theta~ and this rank's fp32 master shard."""
    qz.BLOCK = block
    sent = {"bytes": 0}
    if world > 1:
        a2a, isend = dist.all_to_all_single, dist.isend

        def all_to_all_single(output, input, *args, **kw):
            sent["bytes"] += input.numel() * input.element_size() * (world - 1) // world
            return a2a(output, input, *args, **kw)

        def counted_isend(tensor, *args, **kw):
            sent["bytes"] += tensor.numel() * tensor.element_size()
            return isend(tensor, *args, **kw)

        dist.all_to_all_single, dist.isend = all_to_all_single, counted_isend
    out = []
    for cfg in cfgs:
        model = make_model(kind)
        engine = build_engine(model, cfg)
        rounds, estimates, run = [], [], engine.comm.run
        numel = sum(p.numel() for p in model.parameters())

        def counted(
            payload,
            stats,
            new_params,
            round_kind,
            *args,
            run=run,
            rounds=rounds,
            estimates=estimates,
            numel=numel,
        ):
            sent["bytes"] = 0
            result = run(payload, stats, new_params, round_kind, *args)
            rounds.append((round_kind, sent["bytes"]))
            if round_kind is RoundKind.ESTIMATE:  # theta~ as every worker swaps it in (engine order)
                estimates.append(new_params[:numel].clone())
            return result

        engine.comm.run = counted
        dtype = engine.flat.dtype  # bf16 in mixed precision: the batches too
        records = list(engine.run(([t.to(dtype) for t in b] for b in stream(kind, rank, world)), loss_fn))
        engine.close()
        out.append((parameters_to_vector(model.parameters()).detach(), records, rounds, estimates,
                    engine.comm.optimizer.master.clone()))
    return out
