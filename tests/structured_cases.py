"""The schema, prompts and adapters that the engine's structured-output tests share, on the CPU
(tests/engine/test_structured.py) and on the GPU (tests/gpu/test_structured_gpu.py)."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
}
PROMPTS = ["Tell me a story", "SELECT name", "What is the capital", "A mixture of experts"]
LORAS = [None, "sql", "chat", "sql"]  # the demo model's adapters, and base
