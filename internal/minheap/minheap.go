// Package minheap is a binary min-heap on an int64 time, for the schedulers
// of the MQTT command pusher and the simulator: a slice type (so callers
// read h[0] and len(h) directly), without container/heap's interface calls
// on their hot paths.
package minheap

// Timed is an entry ordered by When (smallest first).
type Timed interface{ When() int64 }

// Heap is a min-heap on When. The zero value is empty and ready.
type Heap[T Timed] []T

// Push adds e.
func (h *Heap[T]) Push(e T) {
	*h = append(*h, e)
	a := *h
	for i := len(a) - 1; i > 0; {
		up := (i - 1) / 2
		if a[up].When() <= a[i].When() {
			break
		}
		a[up], a[i] = a[i], a[up]
		i = up
	}
}

// Pop removes and returns the entry with the smallest When; h must not be
// empty.
func (h *Heap[T]) Pop() T {
	a := *h
	top := a[0]
	n := len(a) - 1
	a[0] = a[n]
	a = a[:n]
	for i := 0; ; {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && a[r].When() < a[l].When() {
			m = r
		}
		if a[i].When() <= a[m].When() {
			break
		}
		a[i], a[m] = a[m], a[i]
		i = m
	}
	*h = a
	return top
}
