"""engine_core.block_manager: block tables, free list, ref counts, watermark. No torch."""

import random

import pytest

from engine_core.block_manager import BlockManager, NoFreeBlocks


def test_allocate_rounds_up_to_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    assert bm.allocate("a", 9) == (0, 1, 2)  # ceil(9 / 4) = 3 blocks, taken from the left of the free list
    assert bm.allocate("b", 4) == (3,)
    assert bm.num_tokens("a") == 9 and bm.num_free_blocks == 6 and bm.usage == pytest.approx(0.4)
    bm.free("a")
    assert bm.num_free_blocks == 9 and "a" not in bm
    bm.check()
    # freed blocks are reused last (appended on the right): the next allocation takes the never-used ones first
    assert bm.allocate("c", 12) == (4, 5, 6)


def test_append_adds_a_block_only_at_a_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0)
    bm.allocate("a", 3)
    assert bm.blocks_to_append("a", 1) == 0 and bm.append("a", 1) == ()  # slot 3 is in block 0
    assert bm.blocks_to_append("a", 1) == 1 and bm.append("a", 1) == (1,)  # slot 4 opens block 1
    assert bm.block_table("a") == (0, 1) and bm.num_tokens("a") == 5
    assert bm.append("a", 7) == (2,)  # slots 5..11
    assert bm.can_append("a", 4) and not bm.can_append("a", 5)  # 1 free block = 4 more slots
    with pytest.raises(NoFreeBlocks):
        bm.append("a", 5)
    assert bm.num_tokens("a") == 12  # a failed append changes nothing
    bm.check()


def test_allocate_errors_change_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, watermark=0.0)
    with pytest.raises(NoFreeBlocks):
        bm.allocate("a", 9)
    assert bm.num_free_blocks == 2 and "a" not in bm
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", 1)
    bm.check()


def test_watermark_applies_to_admission_only():
    bm = BlockManager(num_blocks=100, block_size=16, watermark=0.05)  # 5 blocks kept in reserve
    assert bm.watermark_blocks == 5
    assert bm.can_allocate(95 * 16) and not bm.can_allocate(95 * 16 + 1)
    assert bm.can_allocate(100 * 16, use_watermark=False)
    bm.allocate("a", 95 * 16)
    assert not bm.can_allocate(1)  # admission would eat into the reserve
    assert bm.can_append("a", 5 * 16)  # growth may use it


def test_fork_shares_only_full_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    bm.allocate("a", 10)  # blocks 0, 1 full; block 2 holds 2 tokens
    assert bm.fork("a", "b") == (0, 1)  # the partial block is not shared: no copy-on-write ever needed
    assert bm.num_tokens("b") == 8
    assert [bm.ref_count(i) for i in range(3)] == [2, 2, 1]
    assert bm.append("b", 1) == (3,)  # b writes into a block of its own
    bm.free("a")
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 0, 1] and bm.num_free_blocks == 5  # shared ones survive
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check()
    bm.allocate("c", 8)
    assert bm.fork("c", "d", num_tokens=7) == bm.block_table("c")[:1]  # 7 tokens round down to 1 full block
    assert bm.num_tokens("d") == 4
    bm.check()


def test_random_operations_keep_the_books_consistent():
    """Seeded property loop: allocate / append / fork / free at random; after every operation the free list holds
    exactly the blocks with ref count 0, no live table points at a free block, and tables cover their tokens."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4, watermark=0.1)
    live: list[int] = []
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(0, 20)
            if bm.can_allocate(n):
                bm.allocate(next_id, n)
                live.append(next_id)
            else:
                assert bm.num_free_blocks - bm.blocks_for(n) < bm.watermark_blocks
            next_id += 1
        elif op < 0.6 and live:
            sid, n = rng.choice(live), rng.randint(1, 6)
            before = bm.block_table(sid)
            if bm.can_append(sid, n):
                new = bm.append(sid, n)
                assert bm.block_table(sid) == before + new
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.append(sid, n)
        elif op < 0.7 and live:
            bm.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check()
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for sid in live:
        bm.free(sid)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check()
