"""Random equivalence with one device: random models and plans (grammar, models, one case, its worker process and
the processes' handling) and issue 36's MobileNetV2 sync batch norm draws."""
