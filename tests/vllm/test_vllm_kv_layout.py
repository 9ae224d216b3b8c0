"""Why vLLM's CPU KV cache migrates by whole blocks (`engines/vllm/migration.py`: no token dim):
CPU attention's own cache write stores a token's key across its whole block (transposed,
[head_dim, block_size]), its value as a row. A token frame, which sends a block's slots one token
at a time, would need slots to be a tensor dimension; here they are not."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_attention_spreads_one_tokens_key_over_its_block(isa) -> None:
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    num_blocks, heads, block_size, head_dim, slot = 4, 2, 32, 64, 5
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim)  # one layer, as vLLM allocates it
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)  # (cpu_attn.py)
    key = torch.arange(1, head_dim + 1, dtype=torch.float32).expand(1, heads, head_dim).contiguous()
    value = torch.full((1, heads, head_dim), 7.0)
    torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                            torch.tensor([block_size + slot]), isa)
    keys, values = cache.view(num_blocks, heads, 2, block_size * head_dim)[1, 0]
    written = keys.nonzero().flatten().tolist()
    assert written == [d * block_size + slot for d in range(head_dim)]  # transposed: a column, not a row
    assert torch.equal(keys[written], key[0, 0])
    assert values.nonzero().flatten().tolist() == list(range(slot * head_dim, (slot + 1) * head_dim))  # a row
