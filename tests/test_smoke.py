
import tensormp as mp


def test_queue_roundtrip_in_process():
    q = mp.SimpleQueue()
    a = mp.ones((4, 4))
    q.put(a[1:, ::2])
    b = q.get()
    assert mp.is_shared(b)
    b[0, 0] = 7
    assert a[1, 0] == 7
    q.close()
