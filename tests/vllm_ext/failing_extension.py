"""A k2-ckpt vLLM worker extension whose commit fails part-way through vLLM's reload, for
tests/test_vllm.py: vLLM's `load_weights` raises after its first 50 tensors, once the layerwise
reload has put the model's layers back in checkpoint form."""

from k2_ckpt.adapters.vllm import VllmWorkerExtension

FAIL_AFTER = 50


class FailingReloadExtension(VllmWorkerExtension):
    def update_weights_from_ipc(self, zmq_handles, staged=True, timeout_s=300.0):
        model = self.model_runner.get_model()
        load = model.load_weights

        def failing(weights):
            def first_then_fail():
                for i, item in enumerate(weights):
                    if i == FAIL_AFTER:
                        raise RuntimeError(f"injected: vLLM's load_weights failed at tensor {item[0]}")
                    yield item

            return load(first_then_fail())

        model.load_weights = failing
        return super().update_weights_from_ipc(zmq_handles, staged=staged, timeout_s=timeout_s)
