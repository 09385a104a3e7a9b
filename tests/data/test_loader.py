"""``ResumableDataLoader``: the sampler's position survives a changed worker count and a state loaded after ``iter``."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher, _PrefetchDataFetcher
from lightning.pytorch.loops.progress import _BatchProgress, _OptimizationProgress, _SchedulerProgress

from lit_seqpack import PlannedBatchSampler
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data._trainer import check_start, restart_epoch, rewind_fit_loop
from lit_seqpack.data.indexed._loader import ResumableDataLoader, loader_workers, sampler_state_of
from lit_seqpack.planning.config import PlanConfig

LENGTHS = [5, 3, 7, 2, 6, 4, 8, 1, 5, 3, 2, 7, 6, 4, 3, 5]


def indices(samples):
    return [sample["i"] for sample in samples]


def loader(num_workers: int) -> ResumableDataLoader:
    sampler = PlannedBatchSampler(LENGTHS, PlanConfig(mode="packing", max_tokens=10, seed=3))
    data = PlannedDataset([{"i": i} for i in range(len(LENGTHS))])
    return ResumableDataLoader(data, batch_sampler=sampler, collate_fn=indices, num_workers=num_workers)


def plan(first: ResumableDataLoader) -> list[list[int]]:
    return first.batch_sampler.plan.rank_microbatches(0)


@pytest.mark.parametrize(("saved", "resumed"), [(0, 0), (0, 2), (2, 0), (2, 1), (1, 1)])
def test_a_changed_worker_count_resumes_from_the_sampler_position(saved: int, resumed: int) -> None:
    first = loader(saved)
    batches = iter(first)
    done = [next(batches) for _ in range(3)]
    state = first.state_dict()
    assert loader_workers(state) == saved and sampler_state_of(state)["position"] == 3
    second = loader(resumed)
    second.load_state_dict(state)
    assert done + list(second) == plan(first)


def test_a_state_loaded_after_iter_is_used_by_that_iterator() -> None:
    first = loader(0)
    batches = iter(first)
    done = [next(batches), next(batches)]
    state = first.state_dict()
    second = loader(2)
    pending = iter(second)  # as Lightning's estimated_stepping_batches does before an FSDP restore
    second.load_state_dict(state)
    assert done + list(pending) == plan(first)


def test_a_state_loaded_after_batches_were_drawn_makes_the_stale_iterator_raise() -> None:
    first = loader(0)
    batches = iter(first)
    next(batches)
    first.load_state_dict(first.state_dict())
    with pytest.raises(RuntimeError, match=r"Call iter\(loader\) again"):
        next(batches)
    assert len(list(first)) == len(plan(first)) - 1  # a new iterator continues from the loaded state


def test_a_state_without_a_sampler_position_is_refused() -> None:
    with pytest.raises(ValueError, match="not a StatefulDataLoader state"):
        loader(0).load_state_dict({"something": 1})
    with pytest.raises(ValueError, match="no batch sampler state"):
        sampler_state_of({"_index_sampler_state": None})


def test_check_start_follows_the_trainer_and_checks_the_checkpoint() -> None:
    kw = {"accumulate": 2}
    assert check_start(trainer_epoch=1, trainer_position=4, saved=(1, 4), **kw) == (1, 4)
    assert check_start(trainer_epoch=1, trainer_position=4, saved=(1, 5), **kw) == (1, 4)  # microbatch in flight
    assert check_start(trainer_epoch=2, trainer_position=0, saved=(1, 4), **kw) == (2, 0)  # epoch cut by max_steps
    assert check_start(trainer_epoch=1, trainer_position=4, saved=None, **kw) == (1, 4)
    for saved in ((1, 2), (1, 7), (2, 0)):
        with pytest.raises(RuntimeError, match="the checkpoint's loader stopped at"):
            check_start(trainer_epoch=1, trainer_position=4, saved=saved, **kw)
    moved = []
    rewind = lambda n: moved.append(n) or True  # noqa: E731
    assert check_start(trainer_epoch=0, trainer_position=5, saved=(0, 5), rewind=rewind, **kw) == (0, 4)
    assert moved == [1]  # inside a window: back to the start of the step
    for rewind in (None, lambda n: False):
        with pytest.raises(RuntimeError, match=r"inside a gradient-accumulation window .*optimizer step 2"):
            check_start(trainer_epoch=0, trainer_position=5, saved=(0, 5), rewind=rewind, **kw)


def _fit_loop(done: int, fetched: int, prefetched: list | None = None) -> SimpleNamespace:
    def counts(n: int) -> SimpleNamespace:
        return SimpleNamespace(ready=n, started=n, processed=n, completed=n)

    progress = SimpleNamespace(current=counts(done), total=counts(done + 10))
    fetcher = _PrefetchDataFetcher()
    fetcher.fetched, fetcher.batches = fetched, prefetched or []
    return SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress), _data_fetcher=fetcher)


def test_rewind_fit_loop_moves_every_counter_back_or_refuses_an_unknown_state() -> None:
    loop = _fit_loop(5, 5)
    assert rewind_fit_loop(loop, 1)
    assert vars(loop.epoch_loop.batch_progress.current) == dict.fromkeys(
        ("ready", "started", "processed", "completed"), 4
    )
    assert loop.epoch_loop.batch_progress.total.completed == 14 and loop._data_fetcher.fetched == 4
    other_fetcher = _fit_loop(5, 5)
    other_fetcher._data_fetcher = _DataLoaderIterDataFetcher()
    for odd in (_fit_loop(5, 6), _fit_loop(5, 5, prefetched=[{}]), _fit_loop(0, 0), other_fetcher, SimpleNamespace()):
        assert not rewind_fit_loop(odd, 1)


def test_check_start_restarts_the_epoch_when_the_trainer_counts_the_finished_one() -> None:
    """A checkpoint after an epoch's last microbatch, resumed on a layout whose epochs are longer."""
    restarted = []
    restart = lambda n: restarted.append(n) or True  # noqa: E731
    assert check_start(trainer_epoch=1, trainer_position=14, saved=(1, 0), accumulate=2, restart=restart) == (1, 0)
    assert restarted == [14]
    for restart in (None, lambda n: False):  # Lightning's counters not as expected: refused, never guessed
        with pytest.raises(RuntimeError, match="the checkpoint's loader stopped at epoch 1, microbatch 0"):
            check_start(trainer_epoch=1, trainer_position=14, saved=(1, 0), accumulate=2, restart=restart)
    never = lambda n: pytest.fail("restart called")  # noqa: E731
    assert check_start(trainer_epoch=1, trainer_position=4, saved=(1, 4), accumulate=2, restart=never) == (1, 4)


def _finished_epoch_loop(done: int, *, last: bool) -> SimpleNamespace:
    """A fit loop as Lightning restores it from a checkpoint written after microbatch ``done`` of an epoch."""
    progress, scheduler, optim = _BatchProgress(), _SchedulerProgress(), _OptimizationProgress()
    counts = [
        (progress.current, done),
        (progress.total, done + 20),  # earlier epochs: the totals count them too
        (scheduler.current, done // 2),
        (scheduler.total, done // 2),
        (optim.optimizer.step.current, done // 2),
        (optim.optimizer.step.total, done // 2),
    ]
    for tracker, count in counts:
        for name in ("ready", "started", "processed", "completed"):
            if hasattr(tracker, name):
                setattr(tracker, name, count)
    progress.is_last_batch = last
    val = SimpleNamespace(batch_progress=_BatchProgress())
    val.batch_progress.total.completed = 3
    fetcher = _PrefetchDataFetcher()
    fetcher.fetched = done
    epoch_loop = SimpleNamespace(
        batch_progress=progress,
        scheduler_progress=scheduler,
        automatic_optimization=SimpleNamespace(optim_progress=optim),
        val_loop=val,
    )
    return SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher=fetcher)


def test_restart_epoch_resets_what_lightning_resets_at_an_epoch_end() -> None:
    loop = _finished_epoch_loop(14, last=True)
    assert restart_epoch(loop, 14)
    epoch_loop = loop.epoch_loop
    assert epoch_loop.batch_progress.current.ready == epoch_loop.batch_progress.current.completed == 0
    assert not epoch_loop.batch_progress.is_last_batch and loop._data_fetcher.fetched == 0
    assert epoch_loop.batch_progress.total.completed == 34  # those microbatches did train
    assert epoch_loop.scheduler_progress.current.completed == 0
    assert epoch_loop.automatic_optimization.optim_progress.optimizer.step.current.completed == 0
    assert epoch_loop.automatic_optimization.optim_progress.optimizer_steps == 7  # global_step stays
    assert epoch_loop.val_loop.batch_progress.total.completed == 0


def test_restart_epoch_refuses_a_loop_that_is_not_after_an_epochs_last_microbatch() -> None:
    mid_epoch = _finished_epoch_loop(14, last=False)
    assert not restart_epoch(mid_epoch, 14)
    assert mid_epoch.epoch_loop.batch_progress.current.ready == 14  # untouched
    for odd, count in ((_finished_epoch_loop(14, last=True), 13), (SimpleNamespace(), 14)):
        assert not restart_epoch(odd, count)


def test_building_the_loader_warns_nothing():
    """torchdata's StatefulDataLoader calls torch.set_vital (deprecated in torch 2.13) in its constructor; the
    user's warnings show nothing of it (a filter around the constructor only)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader(0)
    assert [str(w.message) for w in caught] == []
