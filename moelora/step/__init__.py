"""What one step is: the data every layer of the engine passes to the next.

The scheduler's plan, the step in flight and what it gives back (`plan`), the requests it
plans for (`request`), the batch the runner lays out and hands the model (`batch`), and the
LoRA batch info, slot weights and folded LoRA halves the kernels read (`lora`). This package
imports nothing of moelora's but the bottom modules (config, errors, sampling parameters), so
every other package can import it.
"""
