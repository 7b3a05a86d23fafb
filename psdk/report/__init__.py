"""What a run leaves for people to read: plots, TensorBoard files, comparisons of runs."""
