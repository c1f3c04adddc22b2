"""BottleFit split computing: bottleneck injection, two-stage training, 8-bit payloads, runtime."""
