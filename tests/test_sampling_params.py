"""SamplingParams and DecodeConfig validation: every bad value is named, nothing is coerced."""

import dataclasses
import math

import numpy as np
import pytest

from dllm_jax import DecodeConfig, DecodeConfigError, GenerationError, SamplingParams, SamplingParamsError

pytestmark = pytest.mark.unit


def test_defaults_and_normalisation():
    p = SamplingParams(stop=["\n", "###"], stop_token_ids=[5, np.int64(7)], temperature=1, seed=np.int32(3))
    assert p.stop == ("\n", "###") and p.stop_token_ids == (5, 7)
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert p.seed == 3 and type(p.seed) is int
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams().remasking == "low_confidence"
    assert isinstance(SamplingParams(), SamplingParams) and issubclass(SamplingParamsError, GenerationError)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0  # frozen


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=0), "max_new_tokens=0: expected an int in"),
        (dict(max_new_tokens=True), r"max_new_tokens=True \(bool\): expected an int"),
        (dict(max_new_tokens=1.5), r"max_new_tokens=1.5 \(float\)"),
        (dict(max_new_tokens="8"), r"max_new_tokens='8' \(str\)"),
        (dict(temperature="0.5"), r"temperature='0.5' \(str\): expected a number"),
        (dict(temperature=math.nan), "temperature=nan: expected a finite number"),
        (dict(temperature=math.inf), "temperature=inf: expected a finite number"),
        (dict(temperature=-0.1), "temperature=-0.1"),
        (dict(temperature=False), r"temperature=False \(bool\)"),
        (dict(top_p=0.0), r"top_p=0.0: expected a number in \(0.0, 1.0\]"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=math.nan), "top_p=nan"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_k=2.0), r"top_k=2.0 \(float\)"),
        (dict(seed=-1), "seed=-1"),
        (dict(seed=2**31), "seed=2147483648"),
        (dict(seed=2**40), "seed=1099511627776"),
        (dict(seed="x"), r"seed='x' \(str\)"),
        (dict(seed=True), r"seed=True \(bool\)"),
        (dict(stop=[""]), "stop contains ''"),
        (dict(stop=[1]), "stop contains 1"),
        (dict(stop=5), r"stop=5 \(int\)"),
        (dict(stop_token_ids=[1.0]), r"stop_token_ids entry=1.0 \(float\)"),
        (dict(stop_token_ids=[-3]), "stop_token_ids entry=-3"),
        (dict(stop_token_ids=7), r"stop_token_ids=7 \(int\)"),
        (dict(cfg_scale=-1.0), "cfg_scale=-1.0"),
        (dict(cfg_scale=math.inf), "cfg_scale=inf"),
        (dict(remasking="greedy"), "remasking='greedy'"),
        (dict(threshold=math.nan), "threshold=nan"),
        (dict(threshold=-0.5), "threshold=-0.5"),
        (dict(gamma=0.0), "gamma=0.0"),
        (dict(gamma=1.01), "gamma=1.01"),
        (dict(gamma="high"), r"gamma='high' \(str\)"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_decode_config_resolves_method_defaults():
    flash = DecodeConfig()
    assert (flash.mask_num, flash.track_num, flash.schedule, flash.cache) == (4, 4, "threshold", None)
    assert (flash.default_threshold, flash.default_gamma, flash.base_seed) == (0.9, 0.8, 0)
    verify = DecodeConfig(verify=True)
    assert (verify.accept, verify.pin) == ("cumprod", "all_commits")
    assert DecodeConfig(method="fast_dllm").cache == "dual"
    assert DecodeConfig(method="fast_dllm").schedule == "threshold"
    assert DecodeConfig(method="fast_dllm", steps=256).fixed_schedule
    assert DecodeConfig(method="fast_dllm", schedule="fixed").fixed_schedule
    assert DecodeConfig(method="llada").fixed_schedule and DecodeConfig(method="dream").fixed_schedule
    assert DecodeConfig(method="llada", cfg=True).cfg


def test_decode_config_request_defaults_are_deprecated_and_never_compiled():
    with pytest.warns(DeprecationWarning, match="set them per request in SamplingParams"):
        old = DecodeConfig(verify=True, gamma=0.5, threshold=0.3, seed=4, temperature=0.5)
    assert (old.default_threshold, old.default_gamma, old.base_seed, old.temperature) == (0.3, 0.5, 4, 0.5)
    assert old == DecodeConfig(verify=True) and hash(old) == hash(DecodeConfig(verify=True))  # one compiled loop
    with pytest.warns(DeprecationWarning), pytest.raises(DecodeConfigError, match="not both"):
        DecodeConfig(method="fast_dllm", steps=256, threshold=0.9)
    with pytest.raises(DecodeConfigError, match="schedule='threshold' does not apply to method='llada'"):
        DecodeConfig(method="llada", schedule="threshold")
    with pytest.raises(DecodeConfigError, match="not both"):
        DecodeConfig(method="fast_dllm", steps=256, schedule="threshold")
    with pytest.raises(TypeError):
        DecodeConfig("flash_cache", 256, 16)  # past gen_length, options are keywords


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gen_length=True), r"gen_length=True \(bool\)"),
        (dict(gen_length=64.0), r"gen_length=64.0 \(float\)"),
        (dict(gen_length="64"), r"gen_length='64'"),
        (dict(gen_length=None), "gen_length=None"),
        (dict(batch_size=1.5), "batch_size=1.5"),
        (dict(batch_size=True), "batch_size=True"),
        (dict(block_length=0), "block_length=0"),
        (dict(mask_num=1.5), r"mask_num=1.5 \(float\)"),
        (dict(track_num="4"), r"track_num='4'"),
        (dict(threshold=math.nan), "threshold=nan"),
        (dict(threshold="0.9"), r"threshold='0.9'"),
        (dict(temperature=math.nan), "temperature=nan"),
        (dict(temperature="0.5"), r"temperature='0.5' \(str\)"),
        (dict(seed="x"), r"seed='x'"),
        (dict(seed=2**40), "seed=1099511627776"),
        (dict(schedule="sometimes"), "schedule='sometimes'"),
        (dict(verify=1), r"verify=1 \(int\): expected True or False"),
        (dict(verify=True, gamma=math.nan), "gamma=nan"),
        (dict(verify=True, gamma=5), "gamma=5.0"),
        (dict(verify=True, accept="best"), "accept='best'"),
        (dict(method="fast_dllm", cache="bogus"), "cache='bogus'"),
        # options that do not apply to the chosen method
        (dict(steps=16), "steps=16 does not apply to method='flash_cache'"),
        (dict(cache="dual"), "cache='dual' does not apply to method='flash_cache'"),
        (dict(method="llada", cache="prefix"), "cache='prefix' does not apply to method='llada'"),
        (dict(method="llada", mask_num=4), "mask_num=4 does not apply to method='llada'"),
        (dict(method="fast_dllm", track_num=2), "track_num=2 does not apply to method='fast_dllm'"),
        (dict(gamma=0.5), "gamma=0.5 applies only with verify=True"),
        (dict(accept="paper"), "accept='paper' applies only with verify=True"),
        (dict(pin="reference"), "pin='reference' applies only with verify=True"),
        (dict(cfg=True), "cfg=True does not apply to method='flash_cache'"),
        (dict(method="fast_dllm", cfg=True), "cfg=True does not apply to method='fast_dllm'"),
        (dict(method="fast_dllm", steps=256, threshold=0.9), "steps .* or threshold, not both"),
    ],
)
def test_decode_config_rejects_bad_and_inapplicable_options(kwargs, match):
    with pytest.raises(DecodeConfigError, match=match):
        DecodeConfig(**kwargs)
