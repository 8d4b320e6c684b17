"""Money arithmetic: exact integers, one documented rounding per statement line."""

from __future__ import annotations

import random
from decimal import Decimal
from fractions import Fraction

import pytest

from loraplex.platform.billing.lines import BASE_MODEL, UsageGroup, build_lines, total_amount
from loraplex.platform.billing.money import format_micros, line_amount, parse_money
from loraplex.platform.billing.pricing import Price, PriceOverride, effective_price


def test_line_amount_rounds_half_up_once():
    assert line_amount(1, 500_000) == 1  # 0.5 micro -> 1
    assert line_amount(1, 499_999) == 0
    assert line_amount(3, 500_000) == 2  # 1.5 -> 2
    assert line_amount(1_000_000, 2_000_000) == 2_000_000
    assert line_amount(0, 123) == 0
    with pytest.raises(ValueError):
        line_amount(-1, 5)


def test_line_amount_matches_exact_rational_rounding_for_random_inputs():
    rng = random.Random(1234)
    for _ in range(2000):
        tokens = rng.randrange(0, 10**12)
        price = rng.randrange(0, 10**9)
        exact = Fraction(tokens * price, 1_000_000)
        expected = int(exact + Fraction(1, 2))  # floor(x + 1/2) for x >= 0
        assert line_amount(tokens, price) == expected


@pytest.mark.parametrize(
    ("text", "micros"),
    [("0", 0), ("0.25", 250_000), ("12.000001", 12_000_001), (" 3 ", 3_000_000), (7, 7_000_000),
     ("1.", 1_000_000), (".5", 500_000), ("0.2500000000", 250_000), ("1000000000", 10**15)],
)
def test_parse_money(text, micros):
    assert parse_money(text) == micros


@pytest.mark.parametrize("text", ["-1", "0.0000001", "abc", "NaN", "Infinity", "", True, "1e30"])
def test_parse_money_refuses_bad_amounts(text):
    with pytest.raises(ValueError):
        parse_money(text)


@pytest.mark.parametrize(("text", "words"), [
    ("1e999999", "plain decimal number"),  # Decimal reads it; scaling it to micro-units overflowed
    ("1E-2", "plain decimal number"), ("1e3", "plain decimal number"), ("nan", "plain decimal number"),
    ("-Infinity", "plain decimal number"), ("sNaN", "plain decimal number"), ("-0", "without a sign"),
    ("+1", "without a sign"), ("1_000", "plain decimal number"), ("1,000", "plain decimal number"),
    ("\u0661\u0662", "plain decimal number"), ("1.2.3", "plain decimal number"), (".", "plain decimal number"),
    ("0x10", "plain decimal number"), ("1000000001", "implausibly large"), ("9" * 5000, "too long"),
    (-1, "negative"), (10**30, "implausibly large"), (Decimal("1e999999"), "finite"), (Decimal("-0"), "finite"),
])
def test_parse_money_takes_only_plain_decimals(text, words):
    with pytest.raises(ValueError, match=words) as caught:
        parse_money(text)
    assert len(str(caught.value)) < 200  # the value is quoted back cut short, never whole


def test_format_micros():
    assert format_micros(250_000) == "0.250000"
    assert format_micros(12_345_678, places=2) == "12.35"
    assert format_micros(5, places=0) == "0"
    assert format_micros(-1_500_000, places=1) == "-1.5"
    assert format_micros(0, places=2) == "0.00"


def test_price_refuses_floats_and_negatives():
    with pytest.raises(ValueError):
        Price(prompt=0.5, completion=1, adapter_surcharge=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Price(prompt=-1, completion=1, adapter_surcharge=0)
    with pytest.raises(ValueError):
        Price(prompt=1, completion=1, adapter_surcharge=0, currency="usd")


def test_override_replaces_only_given_fields():
    plan = Price(prompt=100, completion=200, adapter_surcharge=50, currency="EUR")
    assert effective_price(plan, None) == plan
    assert effective_price(plan, PriceOverride(completion=150)) == Price(100, 150, 50, "EUR")
    assert effective_price(None, PriceOverride(prompt=7)) == Price(7, 0, 0)


def test_lines_cover_every_token_and_sum_exactly():
    rng = random.Random(99)
    price = Price(prompt=150_000, completion=600_000, adapter_surcharge=33_333)
    for _ in range(200):
        groups = [
            UsageGroup(rng.choice([BASE_MODEL, "a@1", "b@2", "a@3"]), 1, rng.randrange(0, 5000), rng.randrange(0, 900))
            for _ in range(rng.randrange(1, 30))
        ]
        lines = build_lines(groups, price)
        prompt = sum(g.prompt_tokens for g in groups)
        completion = sum(g.completion_tokens for g in groups)
        assert sum(line.tokens for line in lines if line.component == "prompt") == prompt
        assert sum(line.tokens for line in lines if line.component == "completion") == completion
        adapter_tokens = sum(g.prompt_tokens + g.completion_tokens for g in groups if g.adapter != BASE_MODEL)
        assert sum(line.tokens for line in lines if line.component == "adapter_surcharge") == adapter_tokens
        assert total_amount(lines) == sum(line_amount(line.tokens, line.unit_price) for line in lines)
        assert all(line.tokens > 0 for line in lines)


def test_base_model_lines_have_no_surcharge_and_come_first():
    price = Price(prompt=1_000_000, completion=2_000_000, adapter_surcharge=500_000)
    lines = build_lines([UsageGroup("z@1", 1, 10, 5), UsageGroup(BASE_MODEL, 2, 100, 50)], price)
    assert [(line.adapter, line.component) for line in lines] == [
        (BASE_MODEL, "prompt"), (BASE_MODEL, "completion"),
        ("z@1", "prompt"), ("z@1", "completion"), ("z@1", "adapter_surcharge"),
    ]
    assert [line.amount for line in lines] == [100, 100, 10, 10, 8]  # 7.5 rounds half up to 8


def test_csv_export_keeps_user_text_from_becoming_a_formula():
    from loraplex.platform.billing.export import rows_to_csv

    text = rows_to_csv([{"key": "=HYPERLINK(\"http://x\")", "amount": 1_500_000, "tokens": 3}])
    assert text.splitlines() == ["key,amount,tokens", "\"'=HYPERLINK(\"\"http://x\"\")\",1.500000,3"]
