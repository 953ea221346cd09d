"""``quantize_moe``: a transformers model quantized one decoder layer at a time (:mod:`.layerwise`), the run's
set-up (:mod:`.run_setup`, :mod:`.calib`, :mod:`.weight_checks`), the step's parts (:mod:`.inputs`,
:mod:`.calibrate`, :mod:`.capture`, :mod:`.experts_capture`, :mod:`.solve`, :mod:`.stores`, :mod:`.importance`) and
what goes around it as hooks (:mod:`.step`, :mod:`.hooks`; :mod:`.offload`, :mod:`.moves`, :mod:`.budget`,
:mod:`.layer_files`, :mod:`.resume`, :mod:`.float_stream`), and :mod:`.sensitivity` and :mod:`.gains` for
``target_bpw``."""
