"""Cost models: fits recover known coefficients, priors hold before data, predictions stay sane."""

from __future__ import annotations

import math
import random

import pytest
from yutu.sched import CostModels, DecodeCostModel, PrefillCostModel, TransferCostModel
from yutu.sched.costs import DECODE_PRIOR, PREFILL_PRIOR, TRANSFER_LATENCY_S, TRANSFER_PRIOR_BPS
from yutu.sched.regression import WindowFit

TRUE = (0.02, 3e-4, 2e-9)  # s, s/token, s/token^2
GRID = [(length, length * q // 4) for length in (64, 256, 512, 2048, 4096, 8192) for q in range(4)]


def true_prefill(length: int, reused: int) -> float:
    n = length - reused
    return TRUE[0] + TRUE[1] * n + TRUE[2] * n * (length + reused)


def fitted(observations: list[tuple[int, int, float]]) -> PrefillCostModel:
    model = PrefillCostModel()
    for length, reused, seconds in observations:
        model.observe(length, reused, seconds)
    return model


def test_prefill_fit_recovers_known_coefficients() -> None:
    model = fitted([(length, p, true_prefill(length, p)) for length, p in GRID])
    assert model.coefficients == pytest.approx(TRUE, rel=1e-9)
    assert model.predict(1000, 200) == pytest.approx(true_prefill(1000, 200), rel=1e-9)


def test_prefill_uses_its_prior_until_enough_samples() -> None:
    model = PrefillCostModel()
    assert model.coefficients == PREFILL_PRIOR
    for length, p in GRID[:7]:  # min_samples is 8
        model.observe(length, p, true_prefill(length, p))
    assert model.coefficients == PREFILL_PRIOR
    assert model.predict(100, 0) == pytest.approx(0.01 + 1e-4 * 100 + 1e-9 * 100 * 100)
    model.observe(*GRID[7], true_prefill(*GRID[7]))
    assert model.coefficients != PREFILL_PRIOR


def test_prefill_fit_ignores_outliers() -> None:
    wild = {3: 20.0, 7: 20.0, 20: 5.0, 11: 0.0, 15: 1e-4}  # stalls, and no-op measurements
    obs = [(length, p, true_prefill(length, p) * wild.get(i, 1.0)) for i, (length, p) in enumerate(GRID)]
    assert fitted(obs).coefficients == pytest.approx(TRUE, rel=1e-9)


def test_prefill_fit_on_noisy_data_stays_close() -> None:
    rng = random.Random(3)
    obs = [(length, p, true_prefill(length, p) * rng.uniform(0.9, 1.1)) for length, p in GRID * 4]
    model = fitted(obs)
    for length, p in GRID:
        assert model.predict(length, p) == pytest.approx(true_prefill(length, p), rel=0.1)


def test_predictions_are_never_negative_even_when_the_data_slopes_down() -> None:
    # Longer prompts measured faster (nonsense): the fit keeps every coefficient >= 0.
    model = fitted([(100 * n, 0, 1.0 - 0.01 * n) for n in range(1, 20)])
    assert all(c >= 0 for c in model.coefficients)
    for length in (1, 100, 10_000, 1_000_000):
        value = model.predict(length, 0)
        assert value >= 0 and math.isfinite(value)


def test_degenerate_data_scales_the_prior() -> None:
    # Every sample at the same point: the prior's shape, scaled to meet the data there.
    model = fitted([(1000, 0, 0.5)] * 10)
    scale = 0.5 / PrefillCostModel().predict(1000, 0)
    assert model.coefficients == pytest.approx(tuple(c * scale for c in PREFILL_PRIOR), rel=1e-12)
    assert model.predict(1000, 0) == pytest.approx(0.5, rel=1e-12)
    assert model.predict(2000, 0) == pytest.approx(PrefillCostModel().predict(2000, 0) * scale, rel=1e-12)


def test_the_window_forgets_old_measurements() -> None:
    model = PrefillCostModel(window=24)
    for length, p in GRID:
        model.observe(length, p, 10 * true_prefill(length, p))  # a slow regime, then the real one
    for length, p in GRID:
        model.observe(length, p, true_prefill(length, p))
    assert model.coefficients == pytest.approx(TRUE, rel=1e-9)


def test_invalid_measurements_raise() -> None:
    model = PrefillCostModel()
    with pytest.raises(ValueError, match="finite and >= 0"):
        model.observe(100, 0, float("nan"))
    with pytest.raises(ValueError, match="finite and >= 0"):
        model.observe(100, 0, -1.0)
    with pytest.raises(ValueError, match="0 <= reused_tokens <= prompt_len"):
        model.predict(100, 101)
    with pytest.raises(ValueError, match="not all zero"):
        WindowFit((0.0, 0.0))


def test_fits_are_deterministic() -> None:
    rng = random.Random(11)
    obs = [(length, p, true_prefill(length, p) * rng.uniform(0.5, 2.0)) for length, p in GRID * 3]
    assert fitted(obs).coefficients == fitted(obs).coefficients


def test_decode_fit_recovers_known_coefficients() -> None:
    true = (0.005, 1e-4, 3e-8)
    model = DecodeCostModel()
    assert model.coefficients == DECODE_PRIOR
    for batch in (1, 4, 16, 32):
        for kv in (100, 5000, 50_000):
            model.observe(batch, kv, true[0] + true[1] * batch + true[2] * kv)
    assert model.coefficients == pytest.approx(true, rel=1e-9)
    assert model.predict(8, 20_000) == pytest.approx(0.005 + 8e-4 + 6e-4, rel=1e-9)


def test_transfer_prior_then_converges_to_the_measured_bandwidth() -> None:
    model = TransferCostModel()
    assert model.bandwidth_bps == TRANSFER_PRIOR_BPS
    assert model.predict(0) == 0.0
    assert model.predict(2_000_000) == TRANSFER_LATENCY_S + 1e-3
    assert model.predict(2_000_000, bandwidth_bps=1e6) == TRANSFER_LATENCY_S + 2.0  # an instance's own
    for _ in range(60):
        model.observe(1 << 20, TRANSFER_LATENCY_S + (1 << 20) / 5e8)  # 500 MB/s measured
    assert model.bandwidth_bps == pytest.approx(5e8, rel=1e-4)
    assert model.num_samples == 60


def test_transfer_one_stall_moves_the_estimate_by_a_bounded_factor() -> None:
    model = TransferCostModel(1e9, latency_s=0.0, alpha=0.2)
    model.observe(1000, 1000.0)  # 1 B/s: clamped to 1/16 of the estimate before averaging
    assert model.bandwidth_bps == pytest.approx(1e9 * 16**-0.2, rel=1e-12)
    model.observe(1 << 20, 0.0)  # faster than the latency: counted as 16x, not infinity
    assert math.isfinite(model.bandwidth_bps)
    before = model.bandwidth_bps
    model.observe(0, 0.5)  # nothing moved: nothing learned
    assert model.bandwidth_bps == before
    with pytest.raises(ValueError, match="finite and >= 0"):
        model.observe(10, float("inf"))


def test_fit_now_gives_the_lazy_coefficients_and_predictions_do_not_refit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fits = 0
    plain_fit = WindowFit._fit

    def counted(self: WindowFit) -> tuple[float, ...]:
        nonlocal fits
        fits += 1
        return plain_fit(self)

    lazy, eager = CostModels(), CostModels()
    for models in (lazy, eager):
        for length, p in GRID:
            models.prefill.observe(length, p, true_prefill(length, p))
            models.decode.observe(length // 64, length, 0.002 + 1e-6 * length)
    monkeypatch.setattr(WindowFit, "_fit", counted)
    eager.fit()  # what the conductor does after each load report
    assert fits == 2
    predictions = (eager.prefill.predict(1000, 200), eager.decode.predict(4, 2048))
    assert fits == 2  # placements read the fit made off their path
    assert predictions == (lazy.prefill.predict(1000, 200), lazy.decode.predict(4, 2048))
    assert fits == 4  # the lazy models fitted at their first prediction
    eager.fit()
    assert fits == 4  # nothing observed since: nothing to fit
