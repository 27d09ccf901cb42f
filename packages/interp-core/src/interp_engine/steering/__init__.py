"""Steering: the write values (``Write``, ``FeatureWrite``, ``SteeringSpec``) and the algebra
every backend applies them with."""
