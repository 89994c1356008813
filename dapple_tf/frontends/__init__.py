"""Front-ends over build_pipeline: tf.estimator, the Trainer loop and the Horovod backend."""
