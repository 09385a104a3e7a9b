"""An exception from a user's ``dataset[i]`` names the index and the dataset class, at setup and in training."""

from __future__ import annotations

import pytest

from lit_seqpack.data.datamodule import SeqPackDataModule


class Broken:
    """A user's dataset whose sample 17 cannot be read (once ``broken`` is set)."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if self.broken and index == 17:
            raise KeyError("text")
        return {"input_ids": [1 + index % 7] * (3 + index % 5)}


def test_an_exception_in_the_setup_scan_names_the_index_and_keeps_its_type():
    dm = SeqPackDataModule(source=Broken(broken=True), max_tokens=32)
    with pytest.raises(KeyError, match=r"dataset\[17\] \(Broken\) raised KeyError: 'text'") as info:
        dm.setup("fit")
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_exception_in_training_names_the_index_with_or_without_workers(num_workers):
    data = Broken(broken=False)
    dm = SeqPackDataModule(source=data, max_tokens=32, num_workers=num_workers)
    dm.setup("fit")
    data.broken = True  # fails only once training reads it (a file removed after setup)
    with pytest.raises(KeyError, match=r"dataset\[17\] \(Broken\) raised KeyError: 'text'"):
        list(dm.train_dataloader())


class TwoArgumentError(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


def test_an_exception_whose_type_takes_no_message_is_wrapped_naming_the_index():
    class Failing(Broken):
        def __getitem__(self, index: int) -> dict[str, list[int]]:
            if index == 17:
                raise TwoArgumentError("shard-3.bin", "checksum mismatch")
            return super().__getitem__(index)

    with pytest.raises(RuntimeError, match=r"dataset\[17\] \(Failing\) raised TwoArgumentError: shard-3.bin"):
        SeqPackDataModule(source=Failing(broken=False), max_tokens=32).setup("fit")


def test_an_exception_in_the_cross_rank_content_digest_names_the_index():
    """The digest ranks compare before their first epoch reads a few samples again (``content_check_samples``)."""
    data = Broken(broken=False)
    dm = SeqPackDataModule(source=data, max_tokens=32, content_check_samples=40)  # every index: 17 among them
    dm.setup("fit")
    digest = dm.train_dataloader().batch_sampler.content_digest
    assert isinstance(digest(), str)
    data.broken = True
    with pytest.raises(KeyError, match=r"dataset\[17\] \(Broken\) raised KeyError: 'text'"):
        digest()
