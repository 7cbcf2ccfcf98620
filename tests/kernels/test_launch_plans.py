"""``kernels.launch_plans``: a site's launches recorded once and launched again with new tensors of
the same layout, its build not run; built again where a fact, a layout, an alias or the tiles
change, or where a launch reads a tensor the site did not name; no tensor kept; a replay that
differs from a build fails under verification.  The launches here go to an observer that records
them (a stand-in kernel: nothing runs)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lime_megatron.kernels import launch_plans, operands
from lime_megatron.kernels.launch_plans import LaunchPlans

KERNEL = object()  # a stand-in: the observer below never runs a launch


@pytest.fixture(autouse=True)
def unverified(monkeypatch):
    """Replays not checked by a build (whose calls the sites below count), unless a test asks."""
    monkeypatch.setattr(launch_plans, "VERIFY", False)


@pytest.fixture
def launched():
    """The launches made in the test, as ``(grid, args, constants)``."""
    made = []
    with operands.launches_observed(lambda launch, run: made.append((launch.grid, launch.args, launch.constants))):
        yield made


class Site:
    """A site whose build launches once over ``tensors`` (keys, values, out) with ``scale`` taken
    from a fact, counting its builds."""

    def __init__(self):
        self.builds = 0
        self.hidden = 1  # a fact the build reads that the site does not pass (see the last test)

    def build(self, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, scale: int) -> None:
        self.builds += 1
        operand = (keys, values, keys.stride(0), (out, out.shape[0] * scale * self.hidden))
        operands.launch(KERNEL, (out.shape[0],), (operand, scale, ()), dict(WIDTH=keys.shape[-1]))

    def launch(self, plans: LaunchPlans, tensors: tuple, scale: int = 2) -> None:
        plans.launch("site", (scale,), tensors, self.build, *tensors, scale)


def tensors(rows: int = 4, width: int = 8) -> tuple[torch.Tensor, ...]:
    return torch.randn(rows, width), torch.randn(rows, width), torch.empty(rows, width)


def test_a_replay_launches_the_new_tensors_without_building(launched):
    plans, site, first, second = LaunchPlans(), Site(), tensors(), tensors()
    site.launch(plans, first)
    site.launch(plans, second)
    assert site.builds == 1 and plans.replays == 1
    (grid, args, constants), (grid_again, args_again, constants_again) = launched
    assert (grid, constants) == (grid_again, constants_again) == ((4,), {"WIDTH": 8})
    (keys, values, stride, (out, size)), scale, empty = args_again
    assert (keys, values, out) == second and (stride, size, scale, empty) == (8, 8, 2, ())
    assert all(t is new for t, new in zip((keys, values, out), second))


@pytest.mark.parametrize(
    "change",
    [
        lambda site, plans: site.launch(plans, tensors(), scale=3),  # a fact
        lambda site, plans: site.launch(plans, tensors(rows=5)),  # a shape
        lambda site, plans: site.launch(plans, tuple(t.t().contiguous().t() for t in tensors())),  # strides
        lambda site, plans: site.launch(plans, tuple(t.double() for t in tensors())),  # a dtype
    ],
    ids=["fact", "shape", "strides", "dtype"],
)
def test_a_changed_signature_builds_again(change, launched):
    plans, site = LaunchPlans(), Site()
    site.launch(plans, tensors())
    change(site, plans)
    assert site.builds == 2 and plans.replays == 0
    site.launch(plans, tensors())  # the site keeps its last plan only: the first one's is gone
    assert site.builds == 3


def test_other_mix_tiles_build_again(launched):
    plans, site = LaunchPlans(), Site()
    site.launch(plans, tensors())
    with operands.use_mix_tiles(operands.MixTiles(elements=64)):
        site.launch(plans, tensors())
    assert site.builds == 2


def test_a_launch_reading_an_unnamed_tensor_is_built_every_time(launched):
    plans, site = LaunchPlans(), Site()
    for _ in range(3):
        keys, values, out = tensors()
        plans.launch("site", (2,), (keys, values), site.build, keys, values, out, 2)  # out not named
    assert site.builds == 3 and plans.replays == 0
    assert [args[0][3][0] for _, args, _ in launched] == [args[0][3][0] for _, args, _ in launched]


def test_tensors_aliased_when_recorded_must_stay_aliased(launched):
    """A launch recorded reading one tensor at two positions read it through the first; tensors
    recorded distinct may be aliased later (each position still gets its own)."""
    plans, site = LaunchPlans(), Site()
    keys, _, out = tensors()
    site.launch(plans, (keys, keys, out))
    site.launch(plans, tensors())  # distinct now
    assert site.builds == 2 and plans.replays == 0
    keys, _, out = tensors()
    site.launch(plans, (keys, keys, out))  # aliased, recorded distinct: replayed
    assert site.builds == 2 and plans.replays == 1
    assert launched[-1][1][0][:2] == (keys, keys)


def test_records_keep_no_tensor(launched):
    plans, site = LaunchPlans(), Site()
    recorded = tensors()
    alive = [weakref.ref(t) for t in recorded]
    site.launch(plans, recorded)
    launched.clear()
    del recorded
    gc.collect()
    assert all(ref() is None for ref in alive)
    site.launch(plans, tensors())
    assert plans.replays == 1


def test_verification_names_a_fact_the_site_did_not_pass(launched, monkeypatch):
    monkeypatch.setattr(launch_plans, "VERIFY", True)
    plans, site = LaunchPlans(), Site()
    site.launch(plans, tensors())
    site.launch(plans, tensors())  # verified: the same launch
    site.hidden = 2  # the build now makes another launch, which the signature cannot see
    with pytest.raises(RuntimeError, match="recorded at 'site' differ from a build of them"):
        site.launch(plans, tensors())
