"""The collective counter on the allgather dispatcher (latent baseline, EP=2): the token
all-gather and reduce-scatter carry the analytic unique-token bytes (T rows of L), and the
analytic model states the k-times cost Multi-View would have there."""

from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes
from megatron_mvmoe.analysis.a2a.counter import count_collectives
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import BATCH, SEQ, ep_layer, global_input, init_ep_layout


def _worker(rank, world_size):
    config, layer = ep_layer("latent", init_ep_layout(world_size), world_size,
                             moe_token_dispatcher_type="allgather")
    with count_collectives(layer) as counter:
        x = global_input(config.hidden_size).requires_grad_(True)
        out, _ = layer(x)
        out.sum().backward()
    return [(r.op, r.phase, r.direction, r.payload, r.input_bytes, r.output_bytes)
            for r in counter.records]


def test_allgather_token_bytes_match_analytic():
    records = run_distributed(_worker, 2)[0]
    shape = CommShape(tokens=SEQ * BATCH, hidden=32, topk=3, latent=16, ep=2)
    volume = dispatch_bytes("latent", "allgather", shape)
    gathers = [r for r in records if r[1] == "token_dispatch" and r[2] == "fwd"
               and r[3] == "tokens"]
    assert gathers and gathers[0][4] == volume.tokens_in == SEQ * BATCH * 16 * 4
    assert gathers[0][5] == volume.tokens_out
    scatters = [r for r in records if r[1] == "token_combine" and r[2] == "fwd"]
    assert scatters and scatters[0][4] == volume.tokens_out and scatters[0][5] == volume.tokens_in
    assert any(r[2] == "bwd" for r in records)
    mv = dispatch_bytes("multi_view", "allgather", shape)
    assert mv.tokens_in == 3 * volume.tokens_in and "refused" in mv.note
