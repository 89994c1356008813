"""Reference models written with plain TF ops and dapple_tf.layer markers."""
