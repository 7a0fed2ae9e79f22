"""/info shows each service's configuration with its secrets redacted, and only its secrets."""

from __future__ import annotations

from yutu.service import is_secret_name, redacted


def test_secrets_are_redacted_by_word_and_counts_of_tokens_are_not() -> None:
    config = {
        "admin_token": "s3cret",
        "api_keys": ["a", "b"],
        "redis_password": "pw",
        "store": {"secret": "x", "max_num_batched_tokens": 512},
        "max_num_batched_tokens": 512,
        "max_total_tokens": 4096,
        "kv_store": True,
        "api_key_file": None,  # unset: shown as unset
        "keys_seen": 3,
    }
    assert redacted(config) == {
        "admin_token": "<redacted>",
        "api_keys": "<redacted>",
        "redis_password": "<redacted>",
        "store": {"secret": "<redacted>", "max_num_batched_tokens": 512},
        "max_num_batched_tokens": 512,
        "max_total_tokens": 4096,
        "kv_store": True,
        "api_key_file": None,
        "keys_seen": "<redacted>",  # a word of the name: erring on the side of hiding
    }
    assert is_secret_name("ADMIN_TOKEN") and not is_secret_name("tokenizer")
