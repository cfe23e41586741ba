"""One GRPO step of ``kvtransform.integrations.trl.GRPOTrainer`` (``shared_prefix=True``) on every rank that
``torch.distributed.run`` starts (CPU, gloo through accelerate): the global batch of 2 prompts x 4 completions split
over the ranks, completions fixed per (prompt, occurrence) so that any split draws the same ones. Rank 0 writes the
mean of the ranks' losses and the rank-averaged gradients (what DDP applies) to OUT. Used by
``tests/test_trl.py::test_two_processes_equal_one``; also its one-process reference (:func:`one_step`).

    python -m torch.distributed.run --nproc_per_node=2 tests/trl_two_process_worker.py MODEL_DIR OUT.pt
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trl import EOS, GRPOTrainer, _trainer  # noqa: E402

GLOBAL_BATCH = 8


def keyed_completions(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Completions of 1-8 tokens keyed by (prompt, its occurrence in the call), every third ending in EOS."""
    seen: dict = {}
    out = []
    for p in prompt_ids:
        k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
        g = torch.Generator().manual_seed((sum((i + 1) * t for i, t in enumerate(p)) * 31 + k) % (1 << 31))
        c = torch.randint(2, 97, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        if k % 3 == 0:
            c[-1] = EOS
        out.append(c)
    return out, None


def one_step(path: str, world_size: int = 1):
    """(this rank's loss, this rank's gradients) of one step with ``GLOBAL_BATCH // world_size`` rows per rank."""
    tr = _trainer(GRPOTrainer, path, shared_prefix=True, per_device_train_batch_size=GLOBAL_BATCH // world_size)
    tr._generate_single_turn = keyed_completions.__get__(tr)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    loss = tr.compute_loss(tr.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach() for n, p in tr.model.named_parameters() if p.grad is not None}


def main():
    import torch.distributed as dist

    path, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    loss, grads = one_step(path, world)
    assert dist.is_initialized() and dist.get_backend() == "gloo", "accelerate did not set up gloo"
    dist.all_reduce(loss)
    for g in grads.values():
        dist.all_reduce(g)
    if dist.get_rank() == 0:
        torch.save({"loss": loss / world, "grads": {n: g / world for n, g in grads.items()}}, out)
    # every rank leaves together and tears gloo down before exit: a rank that exits with the group still up can be
    # aborted by its gloo threads ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
