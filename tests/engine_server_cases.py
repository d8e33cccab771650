"""Requests every embedded server test sends, shared by the HTTP-layer tests
(test_engine_server_http.py) and the end-to-end tests (test_engine_server_e2e.py)."""

# Servers under test run with --context-length CONTEXT --max-new-tokens-limit 200 (tiny vocab 320).
CONTEXT = 256
# (body, a phrase the 400's message must contain)
BAD_BODIES = [
    # SGLang ignores unknown top-level keys but refuses unknown sampling parameters
    ({"input_ids": [1], "sampling_params": {"unknown_field": 1}}, "unknown_field"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**9}}, "max-new-tokens-limit"),
    ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 200}}, "context length"),
    ({"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3},
     "routed_experts_start_len"),
    ({"input_ids": [1] * CONTEXT}, "context length"),
    ({"input_ids": [1], "routed_dp_rank": 2}, "out of range"),
    ({"input_ids": [1], "data_parallel_rank": -1}, "out of range"),
    ({"input_ids": [1], "routed_dp_rank": 0, "data_parallel_rank": 1}, "conflicting"),
    ({"input_ids": []}, "empty"),
    ({"text": ""}, "empty"),
    ({}, "text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "not both"),
    ({"input_ids": [1, 320]}, "outside the vocabulary"),
    ({"input_ids": [-1]}, "outside the vocabulary"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}}, "stop_token_ids"),
    ({"input_ids": "abc"}, "input_ids"),
]
