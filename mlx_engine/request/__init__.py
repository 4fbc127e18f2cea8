"""One request: validate -> plan -> pipeline (prompt, the one loop, output), sampling, stop strings."""
