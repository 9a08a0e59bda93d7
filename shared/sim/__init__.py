"""The `sim` engine backend: engines that sleep for a roofline model's step time instead of running a model."""
