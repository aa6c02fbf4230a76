"""Building a rank's stage: materializing its layers, their stored weights, ties and replicas, built-in models."""
